"""The optional capabilities the weight syncs look for in engines and trainers, and the types
of a weight broadcast. Engines and trainers have a capability by having its methods; these
protocols are what `isinstance` checks against."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import attrs


def _shape(dims: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(n) for n in dims)


@attrs.frozen
class TensorMeta:
    """What a receiver needs to take one tensor off a broadcast: its name, dtype and shape."""

    name: str
    dtype: str
    """A torch dtype name without the "torch." prefix: "float32", "bfloat16", ..."""
    shape: tuple[int, ...] = attrs.field(converter=_shape)


@attrs.frozen
class BroadcastGroup:
    """A torch.distributed group in which the trainer (rank 0) broadcasts weights to engines.

    An engine's ranks are `rank_offset .. rank_offset + ranks - 1`; `world_size` is 1 plus the
    ranks of every engine in the group. `backend` is "nccl" on GPUs ("gloo" where the engine
    supports it, e.g. on CPU).
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = "nccl"
    group_name: str = "weight_update_group"


@runtime_checkable
class DiskWeightLoader(Protocol):
    """Optional inference-engine capability: load weights a weight sync wrote to disk, and bump
    the weight version alone. Engines that run in a server of their own (vLLM, SGLang) have it."""

    async def load_weights_from_disk(self, path: str, version: int) -> None:
        """Load the safetensors files in directory `path` (Hugging Face names; readable by the
        engine's server) as `version`."""

    async def set_weight_version(self, version: int) -> None:
        """Tag later tokens with `version` without loading anything (the weights came another
        way)."""


@runtime_checkable
class BroadcastWeightReceiver(Protocol):
    """Optional inference-engine capability: take weights the trainer broadcasts over a
    torch.distributed group (the engine's own distributed update API)."""

    async def weight_broadcast_ranks(self) -> int:
        """How many ranks this engine takes in the group (its tensor/pipeline-parallel size)."""

    async def join_weight_broadcast(self, group: BroadcastGroup) -> None:
        """Join `group`; returns once joined, so call it concurrently with the trainer's own
        `init_process_group` (rank 0)."""

    async def receive_weight_broadcast(
        self, tensors: Sequence[TensorMeta], version: int | None
    ) -> None:
        """Receive `tensors`, which rank 0 broadcasts in this order concurrently with this call;
        with `version`, later tokens are tagged with it (pass it with the last bucket)."""

    async def leave_weight_broadcast(self) -> None: ...


@runtime_checkable
class WritesWeightFiles(Protocol):
    """Optional trainer capability: write its weights itself as `directory/model.safetensors`
    (Hugging Face names). A trainer in a service of its own has it: the disk sync then has the
    file written straight where the engines load it, never through the controller."""

    def export_weights_to(self, directory: Path) -> Path:
        """Write the weights into `directory` (created if missing); returns the file."""
