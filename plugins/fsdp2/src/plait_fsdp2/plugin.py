"""plait-fsdp2's plugin module: lazy "module:attribute" targets only, so discovery imports no
torch."""

from __future__ import annotations

from plait.api import RegisterTrainerEngine, hookimpl


@hookimpl
def plait_register_trainer_engines(register: RegisterTrainerEngine) -> None:
    register(
        "fsdp2",
        "plait_fsdp2.engine:FSDP2Trainer",
        options="plait_fsdp2.options:FSDP2Options",
        description="FSDP2 (fully_shard) trainer over worker processes: gloo on CPU, NCCL on GPUs",
    )
