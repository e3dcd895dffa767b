"""Weight syncs of the core: in-process tensors, and safetensors on disk.

- `in_process` hands the trainer's tensors to every engine's `apply_weights`; engines in a server
  of their own (vLLM, SGLang) move them on by disk themselves.
- `disk` writes the trainer's weights once per version as safetensors (`<dir>/v<N>/`) and tells
  each engine that can (`plait.protocols.DiskWeightLoader`) to load them from there; others get
  the tensors through `apply_weights`. One write serves many engines, and the directory is the
  hand-off point for syncs that patch checkpoints on disk.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from plait.config import positive
from plait.errors import WeightSyncError
from plait.protocols import DiskWeightLoader, InferenceEngine, TrainerEngine
from plait.types import SyncStats, WeightUpdate

WEIGHTS_FILE = "model.safetensors"


def tensor_nbytes(tensor: Any) -> int:
    """Size in bytes of a torch tensor or numpy array, without importing torch."""
    if hasattr(tensor, "nbytes"):
        return int(tensor.nbytes)
    return int(tensor.numel() * tensor.element_size())


def save_safetensors(tensors: Mapping[str, Any], directory: str | Path) -> Path:
    """Write `tensors` (torch tensors or numpy arrays, by Hugging Face name) as
    `directory/model.safetensors`, atomically (a temporary file, then a rename). Imports torch
    and safetensors on use."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, value in tensors.items():
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
        tensor = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share memory (tied weights exported under two names)
        if tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        out[name] = tensor
    target = directory / WEIGHTS_FILE
    fd, tmp = tempfile.mkstemp(prefix=f".{WEIGHTS_FILE}.", dir=directory)
    os.close(fd)
    try:
        save_file(out, tmp, metadata={"format": "pt"})
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return directory


async def _bounded(step: Awaitable[Any], timeout_s: float, index: int, engine: Any, version: int) -> None:
    try:
        await asyncio.wait_for(step, timeout_s)
    except TimeoutError:
        raise WeightSyncError(
            f"inference engine #{index} ({type(engine).__name__}) did not take weight version "
            f"{version} within {timeout_s:g} s",
            fix="raise sync.options.timeout_s, or check that the engine is not stuck",
        ) from None


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
            await _bounded(engine.apply_weights(update), self.options.timeout_s, index, engine, version)
        nbytes = sum(tensor_nbytes(t) for t in tensors.values()) * len(engines)
        return SyncStats(version=version, bytes=nbytes, seconds=time.perf_counter() - start)


@attrs.frozen
class DiskSyncOptions:
    directory: str | None = None
    """Where versions are written (`<directory>/v<N>/`); it must be readable by every engine's
    server. None = a fresh temporary directory, removed when the process exits."""
    keep: int = attrs.field(default=2, validator=positive)
    """Versions kept on disk; older ones are deleted after each push."""
    timeout_s: float = attrs.field(default=300.0, validator=positive)


class DiskSync:
    def __init__(self, *, options: DiskSyncOptions | None = None) -> None:
        self.options = options or DiskSyncOptions()
        if self.options.directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="plait-weights-")
            self.directory = Path(self._tmp.name)
        else:
            self.directory = Path(self.options.directory).expanduser()

    def version_dir(self, version: int) -> Path:
        return self.directory / f"v{version}"

    async def push(self, trainer: TrainerEngine, engines: Sequence[InferenceEngine], version: int) -> SyncStats:
        start = time.perf_counter()
        tensors = dict(trainer.export_weights())
        path = await asyncio.to_thread(save_safetensors, tensors, self.version_dir(version))
        for index, engine in enumerate(engines):
            if isinstance(engine, DiskWeightLoader):
                step = engine.load_weights_from_disk(str(path), version)
            else:
                step = engine.apply_weights(WeightUpdate(version=version, tensors=tensors))
            await _bounded(step, self.options.timeout_s, index, engine, version)
        self._prune(version)
        nbytes = sum(tensor_nbytes(t) for t in tensors.values())
        return SyncStats(version=version, bytes=nbytes, seconds=time.perf_counter() - start)

    def _prune(self, newest: int) -> None:
        versions = sorted(
            int(p.name[1:]) for p in self.directory.glob("v*") if p.name[1:].isdigit() and int(p.name[1:]) != newest
        )
        for old in versions[: max(0, len(versions) - (self.options.keep - 1))]:
            shutil.rmtree(self.version_dir(old), ignore_errors=True)
