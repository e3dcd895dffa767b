"""The "pool" inference engine: several inference engines (replicas) behind one, elastic.

- **Routing**: each request goes to the replica with the most room, measured: the fewest requests
  in flight for its throughput (tokens per second of its recent requests), within
  `max_in_flight` per replica.
- **Failures**: a request whose replica fails (it died, or answers errors) is sent to another
  replica, at most `max_reissues` times; a replica that no longer answers `health()` leaves the
  pool. A sample is produced once, by the one replica that answered, and names it
  (`SampledSequence.replica`; a run's trained.jsonl lists the replica of every turn it trained).
- **Weights**: an update goes to every replica (in parallel); the pool keeps the newest, and a
  replica that joins gets it before it takes a request.
- **Elasticity**: `scale(n)` adds replicas (built from the last replica spec) or drains and
  removes the newest ones (they take no new request; their running ones finish). With
  `scale_file`, the pool reads the wanted number from that JSON file (`{"replicas": n}`) every
  `poll_s` seconds: `plait scale` writes it. With `autoscale` the pool sizes itself from the
  requests that wait for room (plait_remote.scale.Autoscaler).
- **Pause / resume** go to every replica; one that joins while paused is paused too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import attrs
import structlog

from plait.api import (
    ConfigError,
    DataError,
    EngineError,
    EngineHealth,
    InferenceEngine,
    ModelInput,
    PauseMode,
    PlaitError,
    ResolvedModel,
    SampleResponse,
    SamplingParams,
    WeightUpdate,
)
from plait_remote.options import PoolOptions, ReplicaSpec
from plait_remote.scale import autoscaler_for, drain, start_sizing

log = structlog.get_logger("plait_remote")
T = TypeVar("T")


class _Replica:
    def __init__(self, name: str, engine: InferenceEngine) -> None:
        self.name = name
        self.engine = engine
        self.in_flight = 0
        self.tokens_per_s = 0.0  # a moving average of its requests' generated tokens per second
        self.requests = 0
        self.draining = False

    def load(self) -> float:
        # unmeasured replicas look fast so that each gets tried
        return (self.in_flight + 1) / (self.tokens_per_s or 1e9)


class PoolEngine:
    """`plait.protocols.InferenceEngine` over a pool of replicas (see the module docstring)."""

    def __init__(
        self, model: ResolvedModel, *, options: PoolOptions | None = None, seed: int = 0
    ) -> None:
        self.model = model
        self.options = options or PoolOptions()
        if not self.options.replicas or not any(spec.count for spec in self.options.replicas):
            raise ConfigError(
                "inference.options.replicas",
                "the pool needs at least one replica",
                fix='e.g. replicas = [{engine = "remote", options = {engine = "torch"}, '
                "count = 2}]",
            )
        self._autoscaler = autoscaler_for(self.options, "inference", "inference pool")
        self._seed = seed
        self._built = 0
        self.replicas: list[_Replica] = []
        for spec in self.options.replicas:
            for _ in range(spec.count):
                self.replicas.append(self._build(spec))
        self._version = 0
        self._latest: WeightUpdate | None = None
        self._paused: PauseMode | None = None
        self._room: asyncio.Condition | None = None
        self._membership = asyncio.Lock()
        self._watcher: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self._closed = False

    def _build(self, spec: ReplicaSpec) -> _Replica:
        from plait.api import build

        if spec.engine == "pool":
            raise ConfigError("inference.options.replicas", "a pool's replica cannot be a pool")
        self._built += 1
        engine = build(
            "inference_engine",
            spec.engine,
            self.model,
            options=spec.options,
            options_path="inference.options.replicas",
            seed=self._seed + self._built,
        )
        return _Replica(f"{spec.engine}-{self._built}", engine)

    @property
    def weight_version(self) -> int:
        return self._version

    # -- membership -----------------------------------------------------------------------

    def _condition(self) -> asyncio.Condition:
        if self._room is None:
            self._room = asyncio.Condition()
        if self._watcher is None and not self._closed:
            self._watcher = start_sizing(
                self.options, self._autoscaler, lambda: self.replicas, self.scale, "inference pool"
            )
        return self._room

    async def _notify(self) -> None:
        room = self._condition()
        async with room:
            room.notify_all()

    async def scale(self, replicas: int) -> None:
        """Grow to `replicas` (new ones get the newest weights before they serve) or drain the
        newest down to it."""
        if replicas < 1:
            raise ValueError(f"a pool keeps at least one replica, asked for {replicas}")
        async with self._membership:
            serving = [r for r in self.replicas if not r.draining]
            for _ in range(replicas - len(serving)):
                replica = self._build(self.options.replicas[-1])
                try:
                    if self._latest is not None:
                        await replica.engine.apply_weights(self._latest)
                    if self._paused is not None:
                        await replica.engine.pause(self._paused)
                except BaseException:
                    await replica.engine.close()
                    raise
                self.replicas.append(replica)
                log.info(
                    "replica joined the pool", replica=replica.name, replicas=len(self.replicas)
                )
            drain(serving[replicas:], self._retire, self._retiring)
        await self._notify()

    async def _retire(self, replica: _Replica) -> None:
        room = self._condition()
        async with room:
            await room.wait_for(lambda: replica.in_flight == 0)
        self._forget(replica)
        await replica.engine.close()
        log.info("replica left the pool", replica=replica.name, replicas=len(self.replicas))

    def _forget(self, replica: _Replica) -> None:
        if replica in self.replicas:
            self.replicas.remove(replica)

    # -- requests -------------------------------------------------------------------------

    async def _pick(self) -> _Replica:
        room = self._condition()
        cap = self.options.max_in_flight

        def candidates() -> list[_Replica]:
            return [
                r for r in self.replicas if not r.draining and (cap is None or r.in_flight < cap)
            ]

        async with room:
            queued = (
                self._autoscaler.waiting()
                if self._autoscaler and not candidates()
                else contextlib.nullcontext()
            )
            with queued:
                await room.wait_for(lambda: bool(candidates()) or self._closed)
            if self._closed:
                raise EngineError("the inference pool is closed", fix="build a new engine")
            replica = min(candidates(), key=_Replica.load)
            replica.in_flight += 1
            return replica

    async def _on_replica(
        self, send: Callable[[_Replica], Awaitable[T]], measure: Callable[[T], int]
    ) -> T:
        failures: list[str] = []
        while True:
            replica = await self._pick()
            started = time.monotonic()
            try:
                result = await send(replica)
            except (DataError, ValueError):
                raise  # the request's own fault: the same on any replica
            except PlaitError as exc:
                failures.append(f"{replica.name}: {exc.message}")
                await self._check(replica)
                if len(failures) > self.options.max_reissues:
                    raise EngineError(
                        f"the request failed on {len(failures)} replicas: {'; '.join(failures)}",
                        fix="check the replicas' logs",
                    ) from exc
                log.warning(
                    "re-issuing a request on another replica", failed=replica.name, error=str(exc)
                )
                continue
            finally:
                replica.in_flight -= 1
                await self._notify()
            seconds = time.monotonic() - started
            tokens = measure(result)
            if seconds > 0 and tokens:
                rate = tokens / seconds
                replica.tokens_per_s = (
                    rate if not replica.requests else 0.8 * replica.tokens_per_s + 0.2 * rate
                )
            replica.requests += 1
            return result

    async def _check(self, replica: _Replica) -> None:
        """A replica that no longer answers health() leaves the pool."""
        health = await replica.engine.health()
        if health.ok:
            return
        async with self._membership:
            self._forget(replica)
        log.warning(
            "replica left the pool: it is not healthy", replica=replica.name, detail=health.detail
        )
        with contextlib.suppress(Exception):
            await replica.engine.close()
        if not self.replicas:
            raise EngineError(
                "every replica of the inference pool failed "
                f"(last: {replica.name}: {health.detail})",
                fix="check the replicas' logs",
            )

    async def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> SampleResponse:
        async def tagged(replica: _Replica) -> SampleResponse:
            reply = await replica.engine.sample(prompt, num_samples, sampling_params)
            return attrs.evolve(
                reply, sequences=[attrs.evolve(s, replica=replica.name) for s in reply.sequences]
            )

        return await self._on_replica(
            tagged, lambda reply: sum(len(s.tokens) for s in reply.sequences)
        )

    async def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        return await self._on_replica(
            lambda replica: replica.engine.compute_logprobs(prompt), lambda _: 0
        )

    # -- control --------------------------------------------------------------------------

    async def _everywhere(self, call: Callable[[InferenceEngine], Awaitable[Any]]) -> None:
        async with self._membership:
            await asyncio.gather(*(call(r.engine) for r in self.replicas))

    async def pause(self, mode: PauseMode = "keep") -> None:
        self._paused = mode
        await self._everywhere(lambda engine: engine.pause(mode))

    async def resume(self) -> None:
        self._paused = None
        await self._everywhere(lambda engine: engine.resume())

    async def apply_weights(self, update: WeightUpdate) -> None:
        if update.kind != "full":
            raise EngineError(
                "the inference pool takes full weight updates "
                "(a replica that joins later gets the newest)",
                fix='use sync.options.payload = "full"',
            )
        await self._everywhere(lambda engine: engine.apply_weights(update))
        self._latest = update if update.tensors else self._latest
        self._version = update.version

    async def health(self) -> EngineHealth:
        healths = await asyncio.gather(*(r.engine.health() for r in self.replicas))
        ok = [h.ok for h in healths]
        detail = ", ".join(
            f"{r.name}: {'ok' if h.ok else h.detail}{' (draining)' if r.draining else ''}"
            for r, h in zip(self.replicas, healths, strict=True)
        )
        return EngineHealth(
            any(ok), self._version, f"{sum(ok)} of {len(ok)} replicas healthy; {detail}"
        )

    async def close(self) -> None:
        self._closed = True
        for task in [self._watcher, *self._retiring]:
            if task is not None:
                task.cancel()
        await self._notify()
        for replica in list(self.replicas):
            with contextlib.suppress(Exception):
                await replica.engine.close()
        self.replicas.clear()
