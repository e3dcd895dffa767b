"""`sync.method = "distributed"`: weight updates over a torch.distributed group (gloo on CPU,
NCCL on GPUs), from the trainer (rank 0) to receiver processes (ranks 1..N).

A receiver runs next to each engine (or each tensor-parallel shard of one) and applies what
arrives to it: `WeightReceiver(target, ...).run()`, where `target` is an inference engine or a
`WeightStore` (named tensors; what a sharded engine worker holds). Every payload and layout of
`plait_weights.sync` works: a push is one or more packed updates (`plait_weights.patch.pack`),
each sent as one flat byte buffer (broadcast for the Hugging Face layout, point-to-point to each
receiver for the tensor-parallel one, where rank r gets only its shards).

Control runs through the group's TCPStore, so that no collective starts unless every receiver
is known to be there and every stage has a deadline that names who missed it:

    receiver: peer/<rank>          = {name, pid, host, tp_rank}      (on joining)
    trainer:  push/<seq>           = {version}
    receiver: ready/<seq>/<rank>   = {version it holds}
    trainer:  plan/<seq>           = {per tp rank: the headers of its updates}
    (collectives: one buffer per update)
    receiver: got/<seq>/<rank>     = number of buffers received
    receiver: done/<seq>/<rank>    = {version} or {error}
    trainer:  stop                 (close)

A receiver that does not answer a stage within `timeout_s` (a hung or stopped process, an
engine stuck in `apply_weights`) fails the push with a `WeightSyncError` naming it (its name,
rank, pid and host); the collective itself runs in a thread bounded by the same deadline and by
the process group's own timeout. After such a failure the group is not reused: the sync refuses
further pushes and says so. Imports torch.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import attrs
import structlog
import torch
import torch.distributed as dist

from plait.api import (
    InferenceEngine,
    SyncStats,
    TrainerEngine,
    WeightSyncError,
    WeightUpdate,
    positive,
)
from plait_weights import patch as weight_patch
from plait_weights.sync import Push, SyncOptions, WeightPublisher, _stats

log = structlog.get_logger("plait_weights.distributed")

STORE_PREFIX = "plait-sync"
_POLL_S = 0.02


@attrs.frozen(kw_only=True)
class DistributedSyncOptions(SyncOptions):
    master_address: str = "127.0.0.1"
    """Where the trainer hosts the group's store; receivers connect to it."""
    master_port: int = attrs.field(default=29_600, validator=positive)
    backend: Literal["gloo", "nccl"] = "gloo"
    """gloo: CPU tensors (any machine); nccl: CUDA tensors on every rank."""
    receivers: int = attrs.field(default=1, validator=positive)
    """Receiver processes that join the group (ranks 1..N)."""
    join_timeout_s: float = attrs.field(default=600.0, validator=positive)
    """How long receivers may take to join, counted from the first push."""


class WeightTarget(Protocol):
    """What a receiver feeds: an inference engine, or a `WeightStore`."""

    @property
    def weight_version(self) -> int: ...

    async def apply_weights(self, update: WeightUpdate) -> None: ...


class WeightStore:
    """Named tensors that take weight updates: the weights of a sharded engine worker, or of any
    receiver that only keeps them. Full updates replace tensors, deltas patch them (checksum
    checked); `weight_version` is the version last applied."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor] | None = None, version: int = -1
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self._version = version

    @property
    def weight_version(self) -> int:
        return self._version

    async def apply_weights(self, update: WeightUpdate) -> None:
        if update.kind == "delta":
            fresh = {
                n: p.values.reshape(p.shape).clone()
                for n, p in update.tensors.items()
                if n not in self.tensors and p.dense
            }
            try:
                weight_patch.apply_update(
                    {**self.tensors, **fresh}, update, held_version=self._version
                )
            except ValueError as exc:
                raise WeightSyncError(
                    f"weight update {update.version} does not apply: "
                    f"{getattr(exc, 'message', exc)}",
                    fix=getattr(exc, "fix", None),
                ) from exc
            self.tensors.update(fresh)
        else:
            self.tensors.update(
                {name: torch.as_tensor(t).clone() for name, t in update.tensors.items()}
            )
            try:
                weight_patch.verify(self.tensors, update)
            except ValueError as exc:
                raise WeightSyncError(f"weight update {update.version}: {exc}") from exc
        self._version = update.version

    def checksum(self) -> str:
        return weight_patch.checksum(self.tensors.items())


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _process_group(store: Any, backend: str, rank: int, world_size: int, timeout_s: float) -> Any:
    prefixed = dist.PrefixStore(f"{STORE_PREFIX}/pg", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, world_size, _timeout(timeout_s))
    if not hasattr(dist, "ProcessGroupNCCL") or not torch.cuda.is_available():
        raise WeightSyncError(
            "the NCCL backend needs a CUDA build of torch and a GPU on every rank",
            fix="set sync.options.backend = 'gloo' on machines without GPUs",
        )
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = _timeout(timeout_s)
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


def _device(backend: str) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if backend == "nccl"
        else torch.device("cpu")
    )


class _Store:
    """The group's TCPStore with JSON values and deadline-bounded waits that name the missing."""

    def __init__(self, store: Any) -> None:
        self.raw = store

    def put(self, key: str, value: Any) -> None:
        self.raw.set(f"{STORE_PREFIX}/{key}", json.dumps(value))

    def has(self, key: str) -> bool:
        return bool(self.raw.check([f"{STORE_PREFIX}/{key}"]))

    def get(self, key: str) -> Any:
        return json.loads(self.raw.get(f"{STORE_PREFIX}/{key}"))

    async def wait_all(self, keys: Mapping[int, str], deadline: float) -> list[int]:
        """Wait until every key exists or the deadline passes; the ranks still missing."""
        missing = dict(keys)
        while missing:
            for rank in [r for r, key in missing.items() if await asyncio.to_thread(self.has, key)]:
                del missing[rank]
            if not missing or time.monotonic() >= deadline:
                break
            await asyncio.sleep(_POLL_S)
        return sorted(missing)


class DistributedSync:
    """The trainer's side: rank 0 of the group, hosting its store."""

    def __init__(self, *, options: DistributedSyncOptions | None = None) -> None:
        self.options = options or DistributedSyncOptions()
        self.publisher = WeightPublisher(self.options)
        self._store: _Store | None = None
        self._group: Any = None
        self._peers: dict[int, dict[str, Any]] = {}
        self._seq = 0
        self._broken: str | None = None

    @property
    def world_size(self) -> int:
        return 1 + self.options.receivers

    def peer_name(self, rank: int) -> str:
        peer = self._peers.get(rank)
        if peer is None:
            return f"weight receiver rank {rank}"
        return (
            f"weight receiver {peer['name']!r} (rank {rank}, pid {peer['pid']} on {peer['host']})"
        )

    async def _connect(self) -> None:
        o = self.options
        raw = await asyncio.to_thread(
            dist.TCPStore,
            o.master_address,
            o.master_port,
            None,
            True,
            _timeout(o.join_timeout_s),
            False,
        )
        self._store = _Store(raw)
        ranks = range(1, self.world_size)
        missing = await self._store.wait_all(
            {r: f"peer/{r}" for r in ranks}, time.monotonic() + o.join_timeout_s
        )
        if missing:
            raise WeightSyncError(
                f"weight receivers of ranks {missing} did not join the group at "
                f"{o.master_address}:{o.master_port} within {o.join_timeout_s:g} s",
                fix="start one WeightReceiver per rank with this address and port, "
                "or raise sync.options.join_timeout_s",
            )
        self._peers = {r: self._store.get(f"peer/{r}") for r in ranks}
        tp_ranks = sorted({p["tp_rank"] for p in self._peers.values()})
        if not set(tp_ranks) <= set(range(self.publisher.ranks)):
            raise WeightSyncError(
                f"receivers declare tensor-parallel ranks {tp_ranks}, but the layout has "
                f"{self.publisher.ranks}",
                fix="check sync.options.layout and tp_size",
            )
        self._group = await asyncio.to_thread(
            _process_group, raw, o.backend, 0, self.world_size, o.timeout_s
        )
        log.info("weight-sync group ready", receivers=[self.peer_name(r) for r in ranks])

    async def push(
        self, trainer: TrainerEngine, engines: Sequence[InferenceEngine], version: int
    ) -> SyncStats:
        if self._broken is not None:
            raise WeightSyncError(
                f"the weight-sync group broke earlier ({self._broken}) and cannot be reused",
                fix="restart the weight receivers and the run (it resumes from its checkpoint)",
            )
        try:
            return await self._push(trainer, version)
        except WeightSyncError as exc:
            self._broken = exc.message
            raise

    async def _push(self, trainer: TrainerEngine, version: int) -> SyncStats:
        start = time.perf_counter()
        if self._group is None:
            await self._connect()
        assert self._store is not None
        seq = self._seq
        self._seq += 1
        pushes = await asyncio.to_thread(self.publisher.prepare, trainer, version)
        ranks = list(range(1, self.world_size))
        self._store.put(f"push/{seq}", {"version": version})
        await self._wait(seq, "ready", ranks, version, "did not get ready for")
        held = {r: self._store.get(f"ready/{seq}/{r}")["version"] for r in ranks}
        plan = self._plan(pushes, held)
        headers = {t: [weight_patch.pack(u)[0] for u in updates] for t, updates in plan.items()}
        self._store.put(f"plan/{seq}", {str(t): h for t, h in headers.items()})
        nbytes = await self._send(plan, ranks, seq, version)
        await self._wait(seq, "done", ranks, version, "did not apply")
        errors = {r: self._store.get(f"done/{seq}/{r}").get("error") for r in ranks}
        failed = {r: e for r, e in errors.items() if e}
        if failed:
            rank, error = next(iter(failed.items()))
            raise WeightSyncError(
                f"{self.peer_name(rank)} failed to apply weight version {version}: {error}",
                fix="check the receiver's engine "
                "(model and sync.options.dtype must match the trainer's)",
            )
        return _stats(pushes, version, nbytes, start)

    def _plan(
        self, pushes: Sequence[Push], held: Mapping[int, int]
    ) -> dict[int, list[WeightUpdate]]:
        """The updates of each tensor-parallel rank: the delta when every receiver of the rank
        holds its base, else full weights (a broadcast sends one thing to all)."""
        plan = {}
        for tp_rank, push in enumerate(pushes):
            versions = {held[r] for r, p in self._peers.items() if p["tp_rank"] == tp_rank}
            base = versions.pop() if len(versions) == 1 else None
            plan[tp_rank] = push.for_receiver(base)
        return plan

    async def _send(
        self, plan: Mapping[int, list[WeightUpdate]], ranks: list[int], seq: int, version: int
    ) -> int:
        """Send every update: broadcast for one layout rank, else each receiver its rank's.
        Returns the bytes sent."""
        device = _device(self.options.backend)
        nbytes = 0
        for index in range(max(len(updates) for updates in plan.values())):
            buffers = {
                t: weight_patch.to_bytes(weight_patch.pack(updates[index])[1]).to(device)
                for t, updates in plan.items()
                if index < len(updates)
            }
            sends: list[tuple[int | None, torch.Tensor]]  # destination rank, None = broadcast
            if self.publisher.ranks == 1:
                sends = [(None, buffers[0])]
            else:
                sends = [
                    (r, buffers[self._peers[r]["tp_rank"]])
                    for r in ranks
                    if self._peers[r]["tp_rank"] in buffers
                ]
            nbytes += sum(buffer.numel() for _, buffer in sends)
            await self._collective(sends, seq, index, ranks, version)
        return nbytes

    async def _collective(
        self,
        sends: list[tuple[int | None, torch.Tensor]],
        seq: int,
        index: int,
        ranks: list[int],
        version: int,
    ) -> None:
        """Run the sends (destination None = broadcast) in a thread, bounded by the timeout."""

        def run() -> None:
            for destination, buffer in sends:
                if destination is None:
                    self._group.broadcast([buffer], _root()).wait()
                else:
                    self._group.send([buffer], destination, 0).wait()

        try:
            await asyncio.wait_for(asyncio.to_thread(run), self.options.timeout_s)
        except (TimeoutError, RuntimeError, dist.DistError) as exc:
            assert self._store is not None
            behind = [
                r
                for r in ranks
                if not self._store.has(f"got/{seq}/{r}")
                or int(self._store.get(f"got/{seq}/{r}")) <= index
            ]
            names = ", ".join(self.peer_name(r) for r in behind) or "no receiver reported a problem"
            raise WeightSyncError(
                f"sending weight version {version} (buffer {index + 1}) did not finish within "
                f"{self.options.timeout_s:g} s: {type(exc).__name__} {exc}; "
                f"not received by: {names}",
                fix="check the named receivers (a hung process, a dead host), "
                "or raise sync.options.timeout_s",
            ) from None

    async def _wait(self, seq: int, stage: str, ranks: list[int], version: int, what: str) -> None:
        assert self._store is not None
        missing = await self._store.wait_all(
            {r: f"{stage}/{seq}/{r}" for r in ranks}, time.monotonic() + self.options.timeout_s
        )
        if missing:
            names = ", ".join(self.peer_name(r) for r in missing)
            raise WeightSyncError(
                f"{names} {what} weight version {version} within {self.options.timeout_s:g} s",
                fix="check the named receivers (a hung process, a stuck engine), "
                "or raise sync.options.timeout_s",
            )

    async def close(self) -> None:
        if self._store is not None:
            self._store.put("stop", True)


def _root() -> Any:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return options


class WeightReceiver:
    """A receiver's side: joins the group as `rank` and applies every push to `target`."""

    def __init__(
        self,
        target: WeightTarget,
        *,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        name: str = "",
        backend: Literal["gloo", "nccl"] = "gloo",
        tp_rank: int = 0,
        timeout_s: float = 600.0,
    ) -> None:
        self.target = target
        self.address, self.port = master_address, master_port
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.name = name or f"receiver-{rank}"
        self.tp_rank = tp_rank
        self.timeout_s = timeout_s
        self.pushes = 0

    async def run(self) -> None:
        """Join, then apply pushes until the trainer closes the sync."""
        raw = await asyncio.to_thread(
            dist.TCPStore, self.address, self.port, None, False, _timeout(self.timeout_s)
        )
        store = _Store(raw)
        store.put(
            f"peer/{self.rank}",
            {
                "name": self.name,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "tp_rank": self.tp_rank,
            },
        )
        group = await asyncio.to_thread(
            _process_group, raw, self.backend, self.rank, self.world_size, self.timeout_s
        )
        seq = 0
        while True:
            while not await asyncio.to_thread(store.has, f"push/{seq}"):
                if await asyncio.to_thread(store.has, "stop"):
                    return
                await asyncio.sleep(_POLL_S)
            await self._receive(store, group, seq)
            seq += 1

    async def _receive(self, store: _Store, group: Any, seq: int) -> None:
        version = store.get(f"push/{seq}")["version"]
        store.put(f"ready/{seq}/{self.rank}", {"version": self.target.weight_version})
        while not await asyncio.to_thread(store.has, f"plan/{seq}"):
            await asyncio.sleep(_POLL_S)
        headers = store.get(f"plan/{seq}")[str(self.tp_rank)]
        broadcast = len(store.get(f"plan/{seq}")) == 1
        device = _device(self.backend)

        def receive(buffer: torch.Tensor) -> None:
            if broadcast:
                group.broadcast([buffer], _root()).wait()
            else:
                group.recv([buffer], 0, 0).wait()

        updates = []
        for index, header in enumerate(headers):
            specs = weight_patch.piece_specs(header)
            buffer = torch.empty(weight_patch.buffer_size(specs), dtype=torch.uint8, device=device)
            await asyncio.to_thread(receive, buffer)
            store.put(f"got/{seq}/{self.rank}", index + 1)
            updates.append(weight_patch.unpack(header, weight_patch.from_bytes(buffer, specs)))
        try:
            for update in updates:
                await self.target.apply_weights(update)
        except Exception as exc:  # reported to the trainer, which names this receiver
            log.warning(
                "weight update failed", version=version, error=f"{type(exc).__name__}: {exc}"
            )
            store.put(f"done/{seq}/{self.rank}", {"error": f"{type(exc).__name__}: {exc}"})
            return
        self.pushes += 1
        store.put(f"done/{seq}/{self.rank}", {"version": version})
