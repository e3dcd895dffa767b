"""The asynchronous schedule: sampling runs on while the trainer trains.

A producer starts episodes in the run's task order while the trainer loop trains on completed
batches; both share one event loop (the engine decodes and the trainer computes in worker
threads). The order of data is fixed: step s trains on the prompts at positions
[s * groups_per_batch, (s + 1) * groups_per_batch) of `TaskSampler`, each with `group_size`
samples, whatever order they finish in.

- **Staleness bound.** The producer starts the samples of batch b only once the engines hold the
  weights of step b - max_staleness or later. Weight versions only grow while a sample decodes,
  and step b trains at version V0 + b (an optimizer step every step, also one without signal),
  so no trained token lags the policy it updates by more than `max_staleness` versions.
- **In-flight weight updates.** After each optimizer step the engines pause (`update_pause`),
  take the new weights through the configured sync, and resume: "keep" continues running
  sequences under the new weights (their tokens carry the version that produced them), "abort"
  ends them and `run_episode` continues them with a new request, "wait" lets them finish first.
- **Off-policy correction** (`off_policy.correction`): see `Controller.correct_off_policy`.
- **Resume.** A checkpoint holds, beside the trainer state, every completed sample of batches
  not trained yet (their tokens, logprobs and versions). A restarted run trains on those as they
  are and samples the rest again (same seeds): no prompt is lost or trained twice.

Metrics beyond the sync schedule's: `async/staleness_{mean,max}` over trained tokens,
`async/in_flight` and `async/buffered` (samples running / done ahead of the trainer),
`time/stall` (the trainer waiting for its batch), and `progress/restored` (samples trained that
an earlier process sampled).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import structlog

from plait.config import RunConfig
from plait.controller import (
    Components,
    Controller,
    TaskSampler,
    TrainedSample,
    _union_seconds,
    crash_point,
    rollout_metrics,
)
from plait.errors import EngineError, PlaitError
from plait.rollout import run_episode
from plait.serde import from_json, to_json
from plait.trajectory import Trajectory

log = structlog.get_logger("plait.async_schedule")

_SEED_MASK = (1 << 62) - 1


class AsyncController(Controller):
    def __init__(self, config: RunConfig, components: Components, run_dir: Any) -> None:
        super().__init__(config, components, run_dir)
        # position -> sample index -> the sample; only batches not trained yet
        self.completed: dict[int, dict[int, TrainedSample]] = {}
        self.sample_times: dict[tuple[int, int], tuple[float, float]] = {}
        self.engine_step = 0  # the step whose weights the engines hold
        self._changed: asyncio.Condition | None = None
        self._failure: BaseException | None = None
        self._running: set[asyncio.Task[None]] = set()

    # -- the producer -------------------------------------------------------------------

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    @contextlib.asynccontextmanager
    async def rollouts_in_background(self, sampler: TaskSampler) -> AsyncIterator[None]:
        self.engine_step = self.step
        producer = asyncio.create_task(self._produce(sampler), name="plait-rollout-producer")
        try:
            yield
        finally:
            producer.cancel()
            for task in list(self._running):
                task.cancel()
            await asyncio.gather(producer, *self._running, return_exceptions=True)

    async def _produce(self, sampler: TaskSampler) -> None:
        rl = self.config.rl
        lag = self.config.off_policy.max_staleness
        try:
            for batch in range(self.step, rl.steps):
                async with self.changed:
                    await self.changed.wait_for(lambda b=batch: self.engine_step >= b - lag)
                for group in range(rl.groups_per_batch):
                    position = batch * rl.groups_per_batch + group
                    done = self.completed.get(position, {})
                    for index in range(rl.group_size):
                        if index not in done:
                            task = asyncio.create_task(self._sample(position, index, sampler.index(position)))
                            self._running.add(task)
                            task.add_done_callback(self._running.discard)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            await self._fail(exc)

    async def _sample(self, position: int, index: int, task_index: int) -> None:
        rl, split = self.config.rl, self.config.env.train_split
        start = time.perf_counter()
        try:
            task = await self.c.env.get_task(split, task_index)
            seed = ((self.config.run.seed * 1_000_003 + position) * 100_003 + index) & _SEED_MASK
            trajectory = await run_episode(self.c.env, task, self.c.engines[0], self.c.renderer,
                                           self._episode_config(rl.temperature, seed))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # an environment's own failures come back as trajectories
            await self._fail(exc)
            return
        async with self.changed:
            self.completed.setdefault(position, {})[index] = TrainedSample(position, index, task_index,
                                                                           self.attempt, trajectory)
            self.sample_times[(position, index)] = (start, time.perf_counter())
            self.changed.notify_all()
        crash_point("rollout", position // rl.groups_per_batch)

    async def _fail(self, exc: BaseException) -> None:
        log.error("rollout producer failed", error=f"{type(exc).__name__}: {exc}")
        async with self.changed:
            self._failure = exc
            self.changed.notify_all()

    async def _batch(self, step: int) -> list[list[TrainedSample]]:
        """The samples of `step`'s batch, by group, once all have completed."""
        rl = self.config.rl
        positions = range(step * rl.groups_per_batch, (step + 1) * rl.groups_per_batch)

        def ready() -> bool:
            return self._failure is not None or all(
                len(self.completed.get(p, {})) == rl.group_size for p in positions)

        async with self.changed:
            await self.changed.wait_for(ready)
        if self._failure is not None:
            raise PlaitError(f"sampling failed: {type(self._failure).__name__}: {self._failure}",
                             fix="see the error above; the run resumes from its last checkpoint") from self._failure
        return [[self.completed[p][j] for j in range(rl.group_size)] for p in positions]

    # -- one step -------------------------------------------------------------------------

    async def train_step(self, sampler: TaskSampler) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = await self._batch(self.step)
        t_stall = time.perf_counter() - t0
        groups = [[s.trajectory for s in group] for group in batch]
        trajectories = [t for g in groups for t in g]
        metrics = rollout_metrics(groups)
        metrics["time/verify"] = _union_seconds([iv for t in trajectories for iv in t.env_seconds])
        self._write_samples(groups)

        version = self.c.trainer.weight_version
        datums, data_metrics = self.build_datums(groups)
        metrics.update(data_metrics)
        t1 = time.perf_counter()
        datums, correction = await asyncio.to_thread(self.correct_off_policy, datums)
        # An optimizer step every step (none of its groups may carry signal): version = V0 + step,
        # which the staleness bound counts on.
        train_metrics = await asyncio.to_thread(self.train_on, datums)
        t_train = time.perf_counter() - t1
        metrics.update(self._policy_metrics(train_metrics, trajectories, t_train))
        metrics.update(correction)
        samples = [s for group in batch for s in group]
        self.record_trained(samples, version)
        crash_point("trained", self.step)

        t2 = time.perf_counter()
        metrics.update(await self.update_engines())
        t_sync = time.perf_counter() - t2

        staleness = np.concatenate([np.asarray([version - v for turn in t.turns for v in turn.completion.versions()])
                                    for t in trajectories if t.turns] or [np.zeros(0)])
        times = [self.sample_times[(s.position, s.index)] for s in samples if (s.position, s.index) in self.sample_times]
        t_rollout = (max(e for _, e in times) - min(b for b, _ in times)) if times else 0.0
        generated = sum(t.completion_tokens for t in trajectories)
        async with self.changed:
            for group in batch:
                self.completed.pop(group[0].position, None)
            for s in samples:
                self.sample_times.pop((s.position, s.index), None)
            in_flight = len(self._running)
            buffered = sum(len(v) for v in self.completed.values())
        metrics.update({
            "time/rollout": t_rollout, "time/train": t_train, "time/sync": t_sync, "time/stall": t_stall,
            "perf/tokens_per_s/rollout": generated / t_rollout if t_rollout else 0.0,
            "async/staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
            "async/staleness_max": float(staleness.max()) if staleness.size else 0.0,
            "async/in_flight": float(in_flight), "async/buffered": float(buffered),
            "progress/samples": float(self.samples_seen + len(trajectories)),
            "progress/restored": float(sum(s.attempt != self.attempt for s in samples)),
        })
        self.samples_seen += len(trajectories)
        metrics["time/total"] = time.perf_counter() - t0
        return metrics

    async def update_engines(self) -> dict[str, float]:
        """Pause every engine, push the new weights, resume; then let the producer go on."""
        op = self.config.off_policy
        engines = self.c.engines
        await self._bounded(asyncio.gather(*(e.pause(op.update_pause) for e in engines)), "pause")
        try:
            metrics = await self.sync_weights()
            crash_point("sync", self.step)
        finally:
            await self._bounded(asyncio.gather(*(e.resume() for e in engines)), "resume")
        async with self.changed:
            self.engine_step = self.step + 1
            self.changed.notify_all()
        return metrics

    async def _bounded(self, step: Any, what: str) -> None:
        timeout = self.config.off_policy.update_timeout_s
        try:
            await asyncio.wait_for(step, timeout)
        except TimeoutError:
            raise EngineError(f"the inference engines did not {what} within {timeout:g} s for a weight update",
                              fix="raise off_policy.update_timeout_s, or use off_policy.update_pause = 'abort'") from None

    # -- checkpoints ----------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        state = super().checkpoint_state()
        state["completed"] = [
            {"position": s.position, "index": s.index, "task_index": s.task_index, "attempt": s.attempt,
             "trajectory": to_json(s.trajectory)}
            for position in sorted(self.completed) if position >= self.step * self.config.rl.groups_per_batch
            for s in self.completed[position].values()
        ]
        return state

    def restore_state(self, state: dict[str, Any]) -> None:
        self.completed = {}
        for item in state.get("completed", []):
            sample = TrainedSample(item["position"], item["index"], item["task_index"], item["attempt"],
                                   from_json(Trajectory, item["trajectory"]))
            self.completed.setdefault(sample.position, {})[sample.index] = sample
        log.info("restored completed samples of untrained batches", samples=len(state.get("completed", [])))

