"""Weight syncs of the core: payload x layout x transport.

Every sync method (`sync.method`) is a transport; its options choose the other two axes:

- **payload** (`sync.options.payload`): `full` sends every tensor in one update; `bucketed` streams
  them in updates of at most `bucket_mb` (dense `TensorPatch` entries, so each bucket replaces the
  tensors it names); `delta` diffs against what was sent last and sends only changed elements as
  sparse patches (`plait_weights.patch`: a one-byte step of the bit pattern for a bfloat16 element
  that crossed a rounding boundary, else the new value), falling back to a full update for a
  receiver that does not hold the previous version. `dtype` casts the trainer's weights to the
  dtype the engine serves before anything is compared or sent: set it to "bfloat16" for an
  engine that serves bfloat16 weights from float32 master weights, or a delta finds nearly every
  element changed.
- **layout** (`sync.options.layout`): `hf` = Hugging Face names and shapes; `tp` = each rank's
  tensor-parallel shard (`plait_weights.layout`), for receivers that hold one shard each.
- **transport** (the method): `in_process` hands updates to each engine's `apply_weights`; `disk`
  writes them as safetensors under `<directory>/v<N>/` (the hand-off point for engines in a server
  of their own, `plait_weights.capabilities.DiskWeightLoader`); `distributed` sends them over a
  torch.distributed group (gloo on CPU, NCCL on GPUs; `plait_weights.distributed`).

Every transfer is versioned, bounded by `timeout_s` (an engine or peer that does not answer in
time is named in the error, never waited on forever) and measured (`SyncStats`: bytes, seconds,
fraction of elements sent). With `checksum` (on by default for deltas) every update carries the
BLAKE2b of the tensors it names as they must be afterwards, and receivers check it.

Engines must not sample while a push with several updates (buckets) runs: the controller pauses
them around in-flight updates (the synchronous schedule pushes between rollouts).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeGuard

import attrs
import structlog

from plait.api import (
    InferenceEngine,
    SyncStats,
    TrainerEngine,
    WeightSyncError,
    WeightUpdate,
    positive,
)
from plait_weights.capabilities import DiskWeightLoader, WritesWeightFiles
from plait_weights.delta import TensorPatch

log = structlog.get_logger("plait_weights.sync")

WEIGHTS_FILE = "model.safetensors"
PATCH_FILE = "patch-{index:04d}.safetensors"
MANIFEST_FILE = "update.json"
_VERSION_KEY = "plait_version"  # the weight version a receiver checkpoint holds

Payload = Literal["full", "bucketed", "delta"]
Layout = Literal["hf", "tp"]
WireDType = Literal["float32", "bfloat16", "float16"]


def tensor_nbytes(tensor: Any) -> int:
    """Size in bytes of a torch tensor or numpy array, without importing torch."""
    if hasattr(tensor, "nbytes"):
        return int(tensor.nbytes)
    return int(tensor.numel() * tensor.element_size())


def save_safetensors(
    tensors: Mapping[str, Any],
    directory: str | Path,
    *,
    filename: str = WEIGHTS_FILE,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write `tensors` (torch tensors or numpy arrays, by name) as `directory/<filename>`,
    atomically (a temporary file, then a rename). Imports torch and safetensors on use."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, value in tensors.items():
        tensor = (
            value
            if isinstance(value, torch.Tensor)
            else torch.from_numpy(np.ascontiguousarray(value))
        )
        tensor = tensor.detach().to("cpu").contiguous()
        # safetensors refuses tensors that share memory (tied weights exported under two names)
        if tensor.numel() and tensor.data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.data_ptr())
        out[name] = tensor
    target = directory / filename
    fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", dir=directory)
    os.close(fd)
    try:
        save_file(out, tmp, metadata={"format": "pt", **(metadata or {})})
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return directory


async def _bounded(
    step: Awaitable[Any], timeout_s: float, index: int, engine: Any, version: int
) -> None:
    try:
        await asyncio.wait_for(step, timeout_s)
    except TimeoutError:
        raise WeightSyncError(
            f"{_engine_name(index, engine)} did not take weight version {version} "
            f"within {timeout_s:g} s",
            fix="raise sync.options.timeout_s, or check that the engine is not stuck",
        ) from None


def _engine_name(index: int, engine: Any) -> str:
    return f"inference engine #{index} ({type(engine).__name__})"


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SyncOptions:
    """Options every weight sync takes (`sync.options`)."""

    payload: Payload = "full"
    dtype: WireDType | None = None
    """Cast weights to this dtype before sending (the dtype the engine serves); None = as
    exported."""
    layout: Layout = "hf"
    tp_size: int = attrs.field(default=1, validator=positive)
    """Tensor-parallel ranks of the receiving engine (layout "tp")."""
    head_dim: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive))
    """Attention head size of the model (layout "tp" splits attention by heads)."""
    bucket_mb: float = attrs.field(default=256.0, validator=positive)
    """Largest update of a bucketed payload (and of a delta's patches)."""
    checksum: bool | None = None
    """Send a checksum that receivers verify after applying; None = only for delta payloads."""
    timeout_s: float = attrs.field(default=120.0, validator=positive)
    """Longest wait for one engine or peer to take one update."""

    def __attrs_post_init__(self) -> None:
        if self.layout == "tp" and self.head_dim is None:
            raise ValueError(
                "layout 'tp' splits attention by heads: "
                "set head_dim (the model's attention head size)"
            )
        if self.layout == "hf" and self.tp_size != 1:
            raise ValueError("tp_size applies to layout 'tp'; set layout = 'tp' or drop tp_size")

    @property
    def send_checksum(self) -> bool:
        return self.payload == "delta" if self.checksum is None else self.checksum


@attrs.frozen(kw_only=True)
class InProcessSyncOptions(SyncOptions):
    pass


@attrs.frozen(kw_only=True)
class DiskSyncOptions(SyncOptions):
    directory: str | None = None
    """Where versions are written (`<directory>/v<N>/`); it must be readable by every engine's
    server. None = a fresh temporary directory, removed when the process exits."""
    keep: int = attrs.field(default=2, validator=positive)
    """Versions kept on disk; older ones are deleted after each push."""
    timeout_s: float = attrs.field(default=300.0, validator=positive)


# ---------------------------------------------------------------------------------------------
# Payload and layout: what one push sends
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class Push:
    """The updates of one push for one rank: `delta` for receivers holding `base_version`,
    `full` for every other receiver (computed on demand)."""

    version: int
    base_version: int | None
    delta: list[WeightUpdate] | None
    full_updates: Any  # () -> list[WeightUpdate]
    elements: int
    changed_elements: int
    full_bytes: int

    def for_receiver(self, receiver_version: int | None) -> list[WeightUpdate]:
        if self.delta is not None and receiver_version == self.base_version:
            return self.delta
        return self.full_updates()


class WeightPublisher:
    """Payload and layout of a sync, independent of the transport.

    For a delta payload it keeps a snapshot of what it last sent (in the wire dtype, on the
    trainer's device: one extra copy of the served weights) to diff the next version against.
    """

    def __init__(self, options: SyncOptions) -> None:
        self.options = options
        self._snapshots: list[dict[str, Any]] | None = None
        self._snapshot_version: int | None = None

    @property
    def ranks(self) -> int:
        return self.options.tp_size if self.options.layout == "tp" else 1

    def export(self, trainer: TrainerEngine) -> list[dict[str, Any]]:
        """The trainer's weights in the wire dtype, one dict of named tensors per rank."""
        import torch

        dtype = getattr(torch, self.options.dtype) if self.options.dtype else None
        tensors = {
            name: (t.detach().to(dtype) if dtype is not None else t.detach())
            for name, t in trainer.export_weights()
        }
        if self.options.layout == "hf":
            return [tensors]
        from plait_weights.layout import TensorParallelLayout

        assert self.options.head_dim is not None
        layout = TensorParallelLayout(self.options.tp_size, self.options.head_dim)
        try:
            return layout.ranks(tensors)
        except ValueError as exc:
            raise WeightSyncError(
                f"cannot reshard the weights to tensor-parallel size {self.options.tp_size}: {exc}",
                fix="check sync.options.tp_size and sync.options.head_dim against the model",
            ) from None

    def prepare(self, trainer: TrainerEngine, version: int) -> list[Push]:
        """Export, cast, reshard and encode: one `Push` per rank (blocking; run it in a thread)."""
        from plait_weights import patch as weight_patch

        ranks = self.export(trainer)
        pushes = []
        base = self._snapshot_version
        delta_ready = self.options.payload == "delta" and self._snapshots is not None
        for rank, tensors in enumerate(ranks):
            elements = sum(int(t.numel()) for t in tensors.values())
            full_bytes = sum(int(t.numel()) * t.element_size() for t in tensors.values())
            delta = None
            changed = elements
            if delta_ready:
                assert self._snapshots is not None
                patches = self._diff(self._snapshots[rank], tensors)
                changed = sum(weight_patch.patch_elements(p) for p in patches.values())
                delta = self._bucket(
                    patches, tensors, version, base_version=base, base=self._snapshots[rank]
                )
            pushes.append(
                Push(
                    version,
                    base,
                    delta,
                    self._full_factory(tensors, version),
                    elements,
                    changed,
                    full_bytes,
                )
            )
        if self.options.payload == "delta":
            self._remember(ranks, version)
        return pushes

    def _diff(self, snapshot: dict[str, Any], tensors: Mapping[str, Any]) -> dict[str, TensorPatch]:
        from plait_weights import patch as weight_patch

        if snapshot.keys() != tensors.keys():
            changed_names = sorted(snapshot.keys() ^ tensors.keys())
            raise WeightSyncError(
                f"the trainer now exports other tensors than last time ({changed_names[:3]})",
                fix="use one sync per model; a new model needs a new sync",
            )
        return {name: weight_patch.diff(snapshot[name], tensor) for name, tensor in tensors.items()}

    def _remember(self, ranks: list[dict[str, Any]], version: int) -> None:
        if self._snapshots is None:
            self._snapshots = [
                {name: t.clone() for name, t in tensors.items()} for tensors in ranks
            ]
        else:
            for snapshot, tensors in zip(self._snapshots, ranks, strict=True):
                for name, tensor in tensors.items():
                    snapshot[name].copy_(tensor)
        self._snapshot_version = version

    def forget(self) -> None:
        """Drop the snapshot: the next push sends full weights (after a receiver lost its state)."""
        self._snapshots = None
        self._snapshot_version = None

    def _full_factory(self, tensors: dict[str, Any], version: int) -> Any:
        cache: list[list[WeightUpdate]] = []

        def full_updates() -> list[WeightUpdate]:
            if not cache:
                if self.options.payload == "full":
                    cache.append([self._update(tensors, tensors, version, kind="full")])
                else:  # bucketed, and the full fallback of a delta: dense patches in buckets
                    patches = {
                        name: TensorPatch(tuple(t.shape), t.reshape(-1))
                        for name, t in tensors.items()
                    }
                    cache.append(self._bucket(patches, tensors, version, base_version=None))
            return cache[0]

        return full_updates

    def _bucket(
        self,
        patches: Mapping[str, TensorPatch],
        tensors: Mapping[str, Any],
        version: int,
        *,
        base_version: int | None,
        base: Mapping[str, Any] | None = None,
    ) -> list[WeightUpdate]:
        """Delta updates of at most `bucket_mb` each (a larger single patch gets its own); `base`:
        the tensors of `base_version` the patches were made against."""
        from plait_weights import patch as weight_patch

        limit = self.options.bucket_mb * 2**20
        buckets: list[dict[str, TensorPatch]] = [{}]
        size = 0
        for name, patch in patches.items():
            nbytes = weight_patch.patch_nbytes(patch)
            if buckets[-1] and size + nbytes > limit:
                buckets.append({})
                size = 0
            buckets[-1][name] = patch
            size += nbytes
        return [
            self._update(
                bucket,
                tensors,
                version,
                kind="delta",
                base_version=base_version,
                base_checksum=None if base is None else weight_patch.base_checksum(base, bucket),
            )
            for bucket in buckets
        ]

    def _update(
        self,
        entries: Mapping[str, Any],
        tensors: Mapping[str, Any],
        version: int,
        *,
        kind: Literal["full", "delta"],
        base_version: int | None = None,
        base_checksum: str | None = None,
    ) -> WeightUpdate:
        """An update of `entries`; its checksum is that of the new `tensors` it names."""
        checksum = None
        if self.options.send_checksum:
            from plait_weights import patch as weight_patch

            checksum = weight_patch.checksum((name, tensors[name]) for name in entries)
        return WeightUpdate(
            version=version,
            tensors=dict(entries),
            kind=kind,
            checksum=checksum,
            base_version=base_version,
            base_checksum=base_checksum,
        )


def update_nbytes(update: WeightUpdate) -> int:
    from plait_weights import patch as weight_patch

    return weight_patch.update_nbytes(update)


def _stats(
    pushes: Sequence[Push], version: int, nbytes: int, start: float, receivers: int = 1
) -> SyncStats:
    """`full_bytes`: what a full push in the same dtype and layout would have sent."""
    elements = sum(p.elements for p in pushes)
    changed = sum(p.changed_elements for p in pushes)
    return SyncStats(
        version=version,
        bytes=nbytes,
        seconds=time.perf_counter() - start,
        delta_fraction=changed / elements if elements else 0.0,
        full_bytes=sum(p.full_bytes for p in pushes) * receivers,
    )


# ---------------------------------------------------------------------------------------------
# Transports
# ---------------------------------------------------------------------------------------------


class InProcessSync:
    """`sync.method = "in_process"`: updates handed to every engine's `apply_weights`."""

    def __init__(self, *, options: InProcessSyncOptions | None = None) -> None:
        self.options = options or InProcessSyncOptions()
        if self.options.layout != "hf":
            raise WeightSyncError(
                "the in_process sync hands whole tensors to engines in this process; "
                "layout 'tp' needs a transport whose receivers hold one shard each",
                fix="set sync.options.layout = 'hf', or use sync.method = 'distributed' or 'disk'",
            )
        self.publisher = WeightPublisher(self.options)

    async def push(
        self, trainer: TrainerEngine, engines: Sequence[InferenceEngine], version: int
    ) -> SyncStats:
        start = time.perf_counter()
        (push,) = await asyncio.to_thread(self.publisher.prepare, trainer, version)
        nbytes = 0
        for index, engine in enumerate(engines):
            nbytes += await deliver(engine, index, push, self.options.timeout_s)
        return _stats([push], version, nbytes, start, receivers=len(engines))


async def deliver(engine: InferenceEngine, index: int, push: Push, timeout_s: float) -> int:
    """Apply `push` to one in-process engine; a delta the engine refuses (another base, a
    checksum mismatch) is followed by the full weights, with a warning. Returns bytes handed
    over."""
    from plait.api import EngineError

    updates = push.for_receiver(engine.weight_version)
    try:
        for update in updates:
            await _bounded(engine.apply_weights(update), timeout_s, index, engine, push.version)
        return sum(update_nbytes(u) for u in updates)
    except EngineError as exc:
        if updates is not push.delta:
            raise WeightSyncError(
                f"{_engine_name(index, engine)} refused weight version {push.version}: "
                f"{exc.message}",
                fix=exc.fix or "check that the engine serves the trainer's model",
            ) from exc
        log.warning(
            "engine refused a delta update; sending full weights",
            engine=_engine_name(index, engine),
            version=push.version,
            error=exc.message,
        )
        full = push.full_updates()
        for update in full:
            await _bounded(engine.apply_weights(update), timeout_s, index, engine, push.version)
        return sum(update_nbytes(u) for u in updates + full)


class DiskSync:
    """`sync.method = "disk"`: every version written once under `<directory>/v<N>/`.

    A full payload is `v<N>/model.safetensors` (Hugging Face names: any engine's server loads
    it); bucketed and delta payloads are `v<N>/patch-XXXX.safetensors` files (see `write_update`)
    plus `update.json`. Engines that load from disk (`DiskWeightLoader`) get a full directory:
    for patches, the sync keeps a receiver-side checkpoint under `<directory>/receivers/` and
    patches it in place (`apply_patch_to_checkpoint`) before the engine loads it. Other engines
    get the updates read back from disk through `apply_weights`. `sync/bytes` counts what is
    written under `v<N>/`. With layout "tp", rank r's files are in `v<N>/tp<r>/`.

    A trainer that writes its own files (`WritesWeightFiles`: a trainer service) writes a full
    payload into `v<N>/` itself, so weights go from the trainer's service to the engines' without
    passing through the controller; the directory must then be writable by the trainer's service.
    """

    def __init__(self, *, options: DiskSyncOptions | None = None) -> None:
        self.options = options or DiskSyncOptions()
        if self.options.directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="plait-weights-")
            self.directory = Path(self._tmp.name)
        else:
            self.directory = Path(self.options.directory).expanduser()
        self.publisher = WeightPublisher(self.options)
        self._pruning: asyncio.Future[None] | None = None

    def version_dir(self, version: int) -> Path:
        return self.directory / f"v{version}"

    def receiver_dir(self, index: int) -> Path:
        return self.directory / "receivers" / f"engine-{index}"

    async def push(
        self, trainer: TrainerEngine, engines: Sequence[InferenceEngine], version: int
    ) -> SyncStats:
        start = time.perf_counter()
        await self._pruned()
        root = self.version_dir(version)
        await asyncio.to_thread(shutil.rmtree, root, True)
        if self._trainer_writes(trainer):
            return await self._push_written(trainer, engines, root, version, start)
        pushes = await asyncio.to_thread(self.publisher.prepare, trainer, version)
        nbytes = 0
        written: dict[tuple[int, bool], Path] = {}  # (rank, full) -> directory
        for rank, push in enumerate(pushes):
            folder = root / f"tp{rank}" if self.publisher.ranks > 1 else root
            variants = [(False, push.delta)] if push.delta is not None else []
            needs_full = push.delta is None or any(
                engine.weight_version != push.base_version for engine in engines
            )
            if needs_full:
                variants.append((True, push.full_updates()))
            for full, updates in variants:
                target = folder / "full" if full and push.delta is not None else folder
                nbytes += await asyncio.to_thread(write_updates, updates, target)
                written[(rank, full)] = target
        if self.publisher.ranks > 1:
            if engines:
                raise WeightSyncError(
                    "layout 'tp' on disk writes one directory per rank for engines that load "
                    "their own shard; these engines load whole models",
                    fix="set sync.options.layout = 'hf' for these engines",
                )
        else:
            for index, engine in enumerate(engines):
                full = pushes[0].delta is None or engine.weight_version != pushes[0].base_version
                await self._deliver(index, engine, written[(0, full)], version)
        self._prune_later(version)
        return _stats(pushes, version, nbytes, start)

    def _trainer_writes(self, trainer: TrainerEngine) -> TypeGuard[WritesWeightFiles]:
        """Whether the trainer writes its own file (`WritesWeightFiles`) and that file is what
        this sync would write: full weights, as exported (no cast, no resharding), without a
        checksum."""
        o = self.options
        return (
            isinstance(trainer, WritesWeightFiles)
            and o.payload == "full"
            and o.dtype is None
            and o.layout == "hf"
            and not o.send_checksum
        )

    async def _push_written(
        self,
        trainer: WritesWeightFiles,
        engines: Sequence[InferenceEngine],
        root: Path,
        version: int,
        start: float,
    ) -> SyncStats:
        """The trainer writes `root/model.safetensors` itself; the engines load it from there."""
        written = await asyncio.to_thread(trainer.export_weights_to, root)
        if (
            written.resolve() != (root / WEIGHTS_FILE).resolve()
        ):  # the service may name it through symlinks
            raise WeightSyncError(
                f"the trainer wrote its weights to {written}, not to {root / WEIGHTS_FILE}",
                fix="a trainer's export_weights_to must write directory/model.safetensors",
            )
        write_manifest(root, [full_weights_entry(version, checksum=None)])
        for index, engine in enumerate(engines):
            await self._deliver(index, engine, root, version)
        self._prune_later(version)
        nbytes = written.stat().st_size
        return SyncStats(
            version=version,
            bytes=nbytes,
            seconds=time.perf_counter() - start,
            delta_fraction=1.0,
            full_bytes=nbytes,
        )

    async def _deliver(
        self, index: int, engine: InferenceEngine, folder: Path, version: int
    ) -> None:
        if isinstance(engine, DiskWeightLoader):
            path = folder
            if not (
                folder / WEIGHTS_FILE
            ).exists():  # patches: bring the receiver's checkpoint up to date
                path = self.receiver_dir(index)
                await asyncio.to_thread(apply_patch_to_checkpoint, folder, path)
            await _bounded(
                engine.load_weights_from_disk(str(path), version),
                self.options.timeout_s,
                index,
                engine,
                version,
            )
            return
        for update in await asyncio.to_thread(read_updates, folder):
            await _bounded(
                engine.apply_weights(update), self.options.timeout_s, index, engine, version
            )

    async def close(self) -> None:
        await self._pruned()

    def _prune_later(self, newest: int) -> None:
        """Delete old versions in the background: freeing a model's file takes tens of
        milliseconds (measured: 45 ms for 79 MB), which the step need not wait for. The next
        push, or close, waits for it."""
        self._pruning = asyncio.ensure_future(asyncio.to_thread(self._prune, newest))

    async def _pruned(self) -> None:
        pruning, self._pruning = self._pruning, None
        # one from an event loop that has ended was finished or dropped with it (the next prune
        # deletes what it left)
        if pruning is not None and pruning.get_loop() is asyncio.get_running_loop():
            await pruning

    def _prune(self, newest: int) -> None:
        versions = sorted(
            # older ones only: a push that started meanwhile may be writing a newer one
            int(p.name[1:])
            for p in self.directory.glob("v*")
            if p.name[1:].isdigit() and int(p.name[1:]) < newest
        )
        for old in versions[: max(0, len(versions) - (self.options.keep - 1))]:
            shutil.rmtree(self.version_dir(old), ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The on-disk format
# ---------------------------------------------------------------------------------------------


def write_updates(updates: Sequence[WeightUpdate], directory: Path) -> int:
    """Write one push into `directory`; returns the bytes of tensor data written.

    A single full update is `model.safetensors` with Hugging Face names (loadable by any engine).
    Otherwise every update is `patch-XXXX.safetensors`: its `plait_weights.patch.pack` pieces as
    tensors `NAME::gaps` / `NAME::values` / `NAME::escaped` (`plait_weights.patch.piece_names`:
    dense entries have no gaps, patches of values no escaped values), and the pack header (JSON)
    in the file's metadata under "plait". `update.json` lists the files in apply order, written last
    so that a reader never sees a half-written version.
    """
    from plait_weights import patch as weight_patch

    directory.mkdir(parents=True, exist_ok=True)
    files = []
    nbytes = 0
    if len(updates) == 1 and updates[0].kind == "full":
        update = updates[0]
        save_safetensors(update.tensors, directory)
        files.append(full_weights_entry(update.version, checksum=update.checksum))
        nbytes = update_nbytes(update)
    else:
        for index, update in enumerate(updates):
            header, pieces = weight_patch.pack(update)
            named = dict(zip(weight_patch.piece_names(header), pieces, strict=True))
            filename = PATCH_FILE.format(index=index)
            save_safetensors(
                named,
                directory,
                filename=filename,
                metadata={"plait": weight_patch.header_json(header)},
            )
            files.append({"file": filename})
            nbytes += update_nbytes(update)
    write_manifest(directory, files)
    return nbytes


def full_weights_entry(version: int, *, checksum: str | None) -> dict[str, Any]:
    """The manifest entry of a full version: `model.safetensors` with Hugging Face names."""
    return {"file": WEIGHTS_FILE, "version": version, "kind": "full", "checksum": checksum}


def write_manifest(directory: Path, files: Sequence[Mapping[str, Any]]) -> None:
    """`update.json`: the files of a version in apply order; written last, atomically, so that a
    reader never sees a half-written version."""
    from plait_weights import patch as weight_patch

    manifest = directory / MANIFEST_FILE
    tmp = manifest.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": weight_patch.FORMAT, "files": list(files)}))
    os.replace(tmp, manifest)


def read_updates(directory: Path) -> list[WeightUpdate]:
    """The updates `write_updates` wrote into `directory`, in apply order."""
    from safetensors import safe_open

    from plait_weights import patch as weight_patch

    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        raise WeightSyncError(
            f"{directory} holds no complete weight update (no {MANIFEST_FILE})",
            fix="read a version directory the disk sync finished writing",
        )
    manifest = json.loads(manifest_path.read_text())
    updates = []
    for item in manifest["files"]:
        path = directory / item["file"]
        with safe_open(str(path), framework="pt") as f:
            if item.get("kind") == "full":
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
                updates.append(
                    WeightUpdate(
                        version=int(item["version"]),
                        tensors=tensors,
                        kind="full",
                        checksum=item.get("checksum"),
                    )
                )
                continue
            header = json.loads(f.metadata()["plait"])
            pieces = [f.get_tensor(name) for name in weight_patch.piece_names(header)]
        updates.append(weight_patch.unpack(header, pieces))
    return updates


def apply_patch_to_checkpoint(patch_dir: Path, checkpoint_dir: Path) -> None:
    """Bring the checkpoint in `checkpoint_dir` (`model.safetensors`, as the disk sync writes it)
    up to the version in `patch_dir`, in place and atomically. Run it where the engine's server
    reads its weights (slime's `/pull_weights` design): the patch is all that travels.

    A directory holding full weights (model.safetensors) replaces the checkpoint; patches are
    applied to its tensors and checked against their checksums.
    """
    from safetensors.torch import load_file

    from plait_weights import patch as weight_patch

    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if (patch_dir / WEIGHTS_FILE).exists():
        shutil.copyfile(patch_dir / WEIGHTS_FILE, checkpoint_dir / f".{WEIGHTS_FILE}.copy")
        os.replace(checkpoint_dir / f".{WEIGHTS_FILE}.copy", checkpoint_dir / WEIGHTS_FILE)
        return
    base = checkpoint_dir / WEIGHTS_FILE
    tensors: dict[str, Any] = {}
    held: int | None = None
    if base.exists():
        from safetensors import safe_open

        with safe_open(str(base), framework="pt") as f:
            held = int(f.metadata().get(_VERSION_KEY, -1))
        tensors = load_file(str(base))
    version = held
    for update in read_updates(patch_dir):
        if update.base_version is not None and version is None:
            raise WeightSyncError(
                f"{checkpoint_dir} holds no checkpoint, "
                f"but the patches of version {update.version} "
                f"were made against version {update.base_version}",
                fix="push full weights (a new sync does), or apply the versions in order",
            )
        for name, patch in update.tensors.items():
            if name not in tensors:
                if not patch.dense:
                    raise WeightSyncError(
                        f"{checkpoint_dir} lacks tensor {name!r} that a sparse patch changes",
                        fix="push full weights first (a new sync does)",
                    )
                tensors[name] = patch.values.reshape(patch.shape).clone()
        try:
            weight_patch.apply_update(tensors, update, held_version=version)
        except ValueError as exc:
            raise WeightSyncError(
                f"patching {checkpoint_dir} to version {update.version} failed: "
                f"{getattr(exc, 'message', exc)}",
                fix=getattr(exc, "fix", None) or "push full weights (a new sync does)",
            ) from exc
        version = update.version
    save_safetensors(tensors, checkpoint_dir, metadata={_VERSION_KEY: str(version)})
