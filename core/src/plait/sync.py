"""In-process weight sync: the trainer's tensors handed to engines in the same process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import attrs

from plait.errors import WeightSyncError
from plait.protocols import InferenceEngine, TrainerEngine
from plait.types import SyncStats, WeightUpdate


def tensor_nbytes(tensor: Any) -> int:
    """Size in bytes of a torch tensor or numpy array, without importing torch."""
    if hasattr(tensor, "nbytes"):
        return int(tensor.nbytes)
    return int(tensor.numel() * tensor.element_size())


@attrs.frozen
class InProcessSyncOptions:
    timeout_s: float = 120.0


class InProcessSync:
    def __init__(self, *, options: InProcessSyncOptions | None = None) -> None:
        self.options = options or InProcessSyncOptions()

    async def push(self, trainer: TrainerEngine, engines: Sequence[InferenceEngine], version: int) -> SyncStats:
        start = time.perf_counter()
        tensors = dict(trainer.export_weights())
        update = WeightUpdate(version=version, tensors=tensors)
        for index, engine in enumerate(engines):
            try:
                await asyncio.wait_for(engine.apply_weights(update), self.options.timeout_s)
            except TimeoutError:
                raise WeightSyncError(
                    f"inference engine #{index} ({type(engine).__name__}) did not take weight version "
                    f"{version} within {self.options.timeout_s:g} s",
                    fix="raise sync.options.timeout_s, or check that the engine is not stuck",
                ) from None
        nbytes = sum(tensor_nbytes(t) for t in tensors.values()) * len(engines)
        return SyncStats(version=version, bytes=nbytes, seconds=time.perf_counter() - start)
