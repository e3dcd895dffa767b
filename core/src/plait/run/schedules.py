"""The two schedules of the RL loop: how a step gets its batch and how new weights reach the
engines.

**sync** (the default): the step samples its batch with the current weights, trains, and pushes
the new weights; nothing overlaps, so the trainer computes in the event loop's own thread.

**async**: a producer starts episodes in the run's task order while the trainer trains on
completed batches; both share one event loop (the engine decodes and the trainer computes in
worker threads). Step s trains on the prompts at positions `Run.positions(s)`, each with
`group_size` samples, whatever order they finish in, seeded as the sync schedule seeds them.

- Staleness bound: the producer starts the samples of batch b only once the engines hold the
  weights of step b - max_staleness or later. Versions only grow while a sample decodes, and
  step b trains at version V0 + b (an optimizer step every step, also one without signal), so no
  trained token lags the policy it updates by more than `max_staleness` versions.
- In-flight weight updates: after each optimizer step the engines pause (`update_pause`), take
  the new weights, and resume: "keep" continues running sequences under the new weights (their
  tokens carry the version that produced them), "abort" ends them and `run_episode` continues
  them with a new request, "wait" lets them finish first.
- Resume: a checkpoint holds every completed sample of batches not trained yet; a restarted run
  trains on those as they are and samples the rest again (same seeds).

Schedule metrics: `async/in_flight` and `async/buffered` (samples running / done ahead of the
trainer).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

import structlog

from plait.config import OffPolicySection
from plait.errors import EngineError, PlaitError
from plait.protocols import InferenceEngine
from plait.run.checkpoint import crash_point
from plait.run.state import Batch, Run, TrainedSample
from plait.run.steps import collect, publish, sample_groups

log = structlog.get_logger("plait.run")

T = TypeVar("T")


class Schedule(Protocol):
    always_step: bool
    """Take an optimizer step every step, also one without learning signal."""

    def running(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Around the loop: whatever runs beside the trainer."""

    async def batch(self, step: int) -> tuple[Batch, float]:
        """`step`'s samples and the wall time their sampling took."""

    async def compute(self, work: Callable[[], T]) -> T:
        """Run trainer work (blocking) as this schedule needs it run."""

    async def publish(self, step: int) -> dict[str, float]:
        """Bring the trainer's new weights to the engines."""

    def done(self, step: int) -> dict[str, float]:
        """Forget `step`'s batch; the schedule's metrics."""

    def held(self) -> list[TrainedSample]:
        """Completed samples of batches not trained yet (a checkpoint keeps them)."""

    def restore(self, held: Sequence[TrainedSample]) -> None: ...


class SyncSchedule:
    """Sample, train, push, in turn."""

    always_step = False

    def __init__(self, run: Run) -> None:
        self.run = run
        self.metrics: dict[str, float] = {}  # dynamic sampling's, of the step's batch

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        yield

    async def batch(self, step: int) -> tuple[Batch, float]:
        start = time.perf_counter()
        batch, self.metrics = await collect(self.run, step)
        crash_point("rollout", step)
        return batch, time.perf_counter() - start

    async def compute(self, work: Callable[[], T]) -> T:
        return work()

    async def publish(self, step: int) -> dict[str, float]:
        return await publish(self.run.components)

    def done(self, step: int) -> dict[str, float]:
        return self.metrics

    def held(self) -> list[TrainedSample]:
        return []

    def restore(self, held: Sequence[TrainedSample]) -> None:
        """Nothing is held between steps."""


class AsyncSchedule:
    """Sampling runs on, within the staleness bound, while the trainer trains."""

    always_step = True

    def __init__(self, run: Run) -> None:
        self.run = run
        # position -> sample index -> the sample; only batches not trained yet
        self.completed: dict[int, dict[int, TrainedSample]] = {}
        self.sample_times: dict[tuple[int, int], tuple[float, float]] = {}
        self.engine_step = 0  # the step whose weights the engines hold
        self.changed = asyncio.Condition()
        self.failure: BaseException | None = None
        self.in_flight: set[asyncio.Task[None]] = set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        self.engine_step = self.run.state.step
        producer = asyncio.create_task(self._produce(), name="plait-rollout-producer")
        try:
            yield
        finally:
            producer.cancel()
            for task in list(self.in_flight):
                task.cancel()
            await asyncio.gather(producer, *self.in_flight, return_exceptions=True)

    async def _produce(self) -> None:
        run = self.run
        lag = run.config.off_policy.max_staleness
        try:
            for step in range(run.state.step, run.config.rl.steps):
                async with self.changed:
                    await self.changed.wait_for(lambda s=step: self.engine_step >= s - lag)  # type: ignore[misc]  # mypy cannot type a lambda with a default argument
                for position in run.positions(step):
                    done = self.completed.get(position, {})
                    for index in range(run.config.rl.group_size):
                        if index not in done:
                            task = asyncio.create_task(self._sample(position, index))
                            self.in_flight.add(task)
                            task.add_done_callback(self.in_flight.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await self._fail(exc)

    async def _sample(self, position: int, index: int) -> None:
        run = self.run
        task_index = run.sampler.index(position)
        start = time.perf_counter()
        try:
            [[trajectory]] = await sample_groups(
                run.config,
                run.components,
                run.config.env.train_split,
                [task_index],
                1,
                run.config.rl.temperature,
                lambda _g, _j: run.seed(position, index),
                train=True,
            )
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # an environment's own failures come back as trajectories
            await self._fail(exc)
            return
        async with self.changed:
            sample = TrainedSample(position, index, task_index, run.state.attempt, trajectory)
            self.completed.setdefault(position, {})[index] = sample
            self.sample_times[(position, index)] = (start, time.perf_counter())
            self.changed.notify_all()
        crash_point("rollout", position // run.config.rl.groups_per_batch)

    async def _fail(self, exc: BaseException) -> None:
        log.error("rollout producer failed", error=f"{type(exc).__name__}: {exc}")
        async with self.changed:
            self.failure = exc
            self.changed.notify_all()

    async def batch(self, step: int) -> tuple[Batch, float]:
        positions = self.run.positions(step)
        size = self.run.config.rl.group_size

        def ready() -> bool:
            return self.failure is not None or all(
                len(self.completed.get(p, {})) == size for p in positions
            )

        async with self.changed:
            await self.changed.wait_for(ready)
        if isinstance(self.failure, PlaitError):
            raise self.failure  # it names the part that failed (engine, renderer, config)
        if self.failure is not None:
            raise PlaitError(
                f"sampling failed: {type(self.failure).__name__}: {self.failure}",
                fix="see the error above; the run resumes from its last checkpoint",
            ) from self.failure
        batch = [[self.completed[p][j] for j in range(size)] for p in positions]
        times = [
            self.sample_times[(s.position, s.index)]
            for g in batch
            for s in g
            if (s.position, s.index) in self.sample_times
        ]
        return batch, (max(e for _, e in times) - min(b for b, _ in times)) if times else 0.0

    async def compute(self, work: Callable[[], T]) -> T:
        return await asyncio.to_thread(work)

    async def publish(self, step: int) -> dict[str, float]:
        """Pause every engine, push the new weights, resume; then let the producer go on."""
        async with engines_paused(
            [e for p in self.run.components.policies for e in p.engines], self.run.config.off_policy
        ):
            metrics = await publish(self.run.components)
            crash_point("sync", step)
        async with self.changed:
            self.engine_step = step + 1
            self.changed.notify_all()
        return metrics

    def done(self, step: int) -> dict[str, float]:
        for position in self.run.positions(step):
            for index in self.completed.pop(position, {}):
                self.sample_times.pop((position, index), None)
        return {
            "async/in_flight": float(len(self.in_flight)),
            "async/buffered": float(sum(len(v) for v in self.completed.values())),
        }

    def held(self) -> list[TrainedSample]:
        first = self.run.positions(self.run.state.step).start
        return [
            s
            for position in sorted(self.completed)
            if position >= first
            for s in self.completed[position].values()
        ]

    def restore(self, held: Sequence[TrainedSample]) -> None:
        self.completed = {}
        for sample in held:
            self.completed.setdefault(sample.position, {})[sample.index] = sample
        log.info("restored completed samples of untrained batches", samples=len(held))


@contextlib.asynccontextmanager
async def engines_paused(
    engines: Sequence[InferenceEngine], off_policy: OffPolicySection
) -> AsyncIterator[None]:
    """`engines` paused (`update_pause`) for a weight update in flight, resumed whatever happens."""

    async def bounded(work: Awaitable[object], what: str) -> None:
        try:
            await asyncio.wait_for(work, off_policy.update_timeout_s)
        except TimeoutError:
            raise EngineError(
                f"the inference engines did not {what} within "
                f"{off_policy.update_timeout_s:g} s for a weight update",
                fix="raise off_policy.update_timeout_s, or use off_policy.update_pause = 'abort'",
            ) from None

    try:
        await bounded(asyncio.gather(*(e.pause(off_policy.update_pause) for e in engines)), "pause")
        yield
    finally:
        await bounded(asyncio.gather(*(e.resume() for e in engines)), "resume")


def make_schedule(run: Run) -> Schedule:
    return AsyncSchedule(run) if run.config.rl.schedule == "async" else SyncSchedule(run)
