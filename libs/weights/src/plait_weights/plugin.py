"""plait-weights' plugin module: the weight-sync methods, by lazy targets (no torch on import)."""

from __future__ import annotations

from plait.api import RegisterWeightSync, hookimpl


@hookimpl
def plait_register_weight_syncs(register: RegisterWeightSync) -> None:
    register(
        "in_process",
        "plait_weights.sync:InProcessSync",
        options="plait_weights.sync:InProcessSyncOptions",
        description="weights (full, bucketed or delta) handed to engines in this process",
    )
    register(
        "disk",
        "plait_weights.sync:DiskSync",
        options="plait_weights.sync:DiskSyncOptions",
        description="weights (full, bucketed or delta patches) written once as safetensors; "
        "engines load them from disk",
    )
    register(
        "distributed",
        "plait_weights.distributed:DistributedSync",
        options="plait_weights.distributed:DistributedSyncOptions",
        description="weights over a torch.distributed group (gloo/NCCL) "
        "to WeightReceiver processes",
    )
