"""The controller: composes plugins into a run and drives the RL loop.

The synchronous schedule (the embedded default: one process, no servers) runs, every step:

    sample (inference + env) -> verify (env) -> forward/backward (trainer) -> optim_step -> sync

and evaluates on held-out tasks every `eval.every` steps. The controller talks to every component
through its protocol only, so the same code drives in-process engines and remote ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import structlog

from plait.advantages import group_advantages, is_constant
from plait.config import RunConfig, unstructure
from plait.errors import PlaitError, WeightSyncError
from plait.metrics import MetricSink, mean, merge_metrics, pass_at_k
from plait.models import ResolvedModel, resolve_model
from plait.off_policy import importance_correction
from plait.plugins import build, get_registry
from plait.protocols import Environment, InferenceEngine, Renderer, TrainerEngine, WeightSync
from plait.rollout import EpisodeConfig, run_episode
from plait.trajectory import Trajectory, trajectory_to_datums
from plait.types import AdamParams, Datum, SamplingParams

log = structlog.get_logger("plait.controller")

CHECKPOINT_DIR = "checkpoints"
LEDGER_FILE = "trained.jsonl"
CRASH_ENV = "PLAIT_CRASH_AT"


def crash_point(point: str, step: int) -> None:
    """Fault injection for crash-safety tests: with PLAIT_CRASH_AT="<point>:<step>" the process
    SIGKILLs itself here (points: rollout, trained, sync, checkpoint, checkpointed)."""
    if os.environ.get(CRASH_ENV) == f"{point}:{step}":
        log.warning("crashing on purpose", point=point, step=step)
        os.kill(os.getpid(), signal.SIGKILL)


@attrs.define
class Components:
    """Everything a run is composed of, built from the config by the plugin registry."""

    model: ResolvedModel
    trainer: TrainerEngine
    engines: list[InferenceEngine]
    renderer: Renderer
    env: Environment
    sync: WeightSync
    sinks: list[MetricSink]


def build_components(config: RunConfig, run_dir: Path) -> Components:
    model = resolve_model(config.model.name, tokenizer=config.model.tokenizer, dtype=config.model.dtype)
    seed = config.run.seed
    trainer = build("trainer_engine", config.trainer.engine, model, options=config.trainer.options,
                    options_path="trainer.options", seed=seed)
    engine = build("inference_engine", config.inference.engine, model, options=config.inference.options,
                   options_path="inference.options", seed=seed)
    renderer = build("renderer", config.renderer.name, model, options=config.renderer.options,
                     options_path="renderer.options")
    env = build("env", config.env.name, options=config.env.options, options_path="env.options")
    sync = build("weight_sync", config.sync.method, options=config.sync.options, options_path="sync.options")
    sinks = [build("metric_sink", name, run_dir, options=config.metrics.options.get(name, {}),
                   options_path=f"metrics.options.{name}") for name in config.metrics.sinks]
    return Components(model, trainer, [engine], renderer, env, sync, sinks)


class TaskSampler:
    """Deterministic task order: every task once per epoch, in a seeded order per epoch.

    Position p (counted over the whole run) maps to a task index, so a resumed run continues
    exactly where the checkpoint left off.
    """

    def __init__(self, num_tasks: int, seed: int) -> None:
        if num_tasks <= 0:
            raise PlaitError("the training split has no tasks", fix="check env.train_split and env.options")
        self.num_tasks = num_tasks
        self.seed = seed
        self._cache: dict[int, np.ndarray] = {}

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_tasks)
        if self.num_tasks > 1_000_000:  # too many to permute: a seeded affine walk instead
            rng = np.random.default_rng([self.seed, epoch])
            stride = int(rng.integers(1, self.num_tasks))
            while math.gcd(stride, self.num_tasks) != 1:
                stride += 1
            return (int(rng.integers(0, self.num_tasks)) + offset * stride) % self.num_tasks
        if epoch not in self._cache:
            self._cache = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_tasks)}
        return int(self._cache[epoch][offset])

    def batch(self, start: int, size: int) -> list[int]:
        return [self.index(p) for p in range(start, start + size)]


def _union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Wall time during which at least one interval was running."""
    total, current_end = 0.0, -math.inf
    for start, end in sorted(intervals):
        if start > current_end:
            total += end - start
            current_end = end
        elif end > current_end:
            total += end - current_end
            current_end = end
    return total


def rollout_metrics(groups: Sequence[Sequence[Trajectory]], prefix: str = "reward") -> dict[str, float]:
    """Reward, pass@1/pass@k and episode-shape metrics of a batch of groups."""
    trajectories = [t for g in groups for t in g]
    valid = [t for t in trajectories if t.error is None]
    metrics: dict[str, float] = {
        f"{prefix}/mean": mean([t.reward for t in valid]),
        f"{prefix}/pass@1": mean([float(t.correct) for t in valid]),
    }
    valid_groups = [[t for t in g if t.error is None] for g in groups]
    k = max((len(g) for g in groups), default=0)  # the group size; groups that lost samples to errors are left out
    if k > 1 and any(len(v) >= k for v in valid_groups):
        metrics[f"{prefix}/pass@k"] = mean(
            [pass_at_k(len(v), sum(t.correct for t in v), k) for v in valid_groups if len(v) >= k]
        )
        metrics[f"{prefix}/k"] = float(k)
    metrics["env/turns_per_episode"] = mean([t.num_turns for t in valid])
    metrics["env/errors"] = float(len(trajectories) - len(valid))
    metrics["env/tool_errors"] = float(sum(t.tool_errors for t in trajectories))
    metrics["env/parse_errors"] = float(sum(t.parse_errors for t in trajectories))
    metrics["env/bridged_turns"] = float(sum(t.bridged_turns for t in trajectories))
    metrics["env/truncated"] = mean([float(t.truncated) for t in valid])
    metrics["data/prompt_tokens"] = mean([t.prompt_tokens for t in valid])
    metrics["data/response_tokens"] = mean([t.completion_tokens for t in valid])
    return metrics


class Controller:
    """Runs one policy (trainer + inference engines) on one environment, synchronously.

    The asynchronous schedule (`plait.async_schedule.AsyncController`) subclasses it."""

    def __init__(self, config: RunConfig, components: Components, run_dir: Path) -> None:
        self.config = config
        self.c = components
        self.run_dir = run_dir
        self.step = 0
        self.samples_seen = 0
        # 0 for a fresh start, else the loaded checkpoint's attempt + 1: a sample whose attempt is
        # lower than the process's was sampled before the checkpoint it resumed from
        self.attempt = 0
        self.history: list[dict[str, float]] = []
        self.eval_history: list[tuple[int, float]] = []

    # -- rollouts --------------------------------------------------------------------------

    def _sampling(self, temperature: float, seed: int) -> SamplingParams:
        rl = self.config.rl
        return SamplingParams(max_tokens=rl.max_tokens, temperature=temperature, top_p=rl.top_p,
                              top_k=rl.top_k, seed=seed)

    def _episode_config(self, temperature: float, seed: int) -> EpisodeConfig:
        rl = self.config.rl
        return EpisodeConfig(sampling=self._sampling(temperature, seed), max_turns=rl.max_turns,
                             reward_reduce=rl.reward_reduce, env_timeout_s=rl.env_timeout_s,
                             max_episode_tokens=rl.max_episode_tokens)

    async def rollout_groups(self, split: str, indices: Sequence[int], group_size: int,
                             temperature: float, seed_base: int) -> list[list[Trajectory]]:
        """`group_size` episodes on each task, all running concurrently (the engine batches them)."""
        engine = self.c.engines[0]
        tasks = await asyncio.gather(*(self.c.env.get_task(split, i) for i in indices))
        coros = [
            run_episode(self.c.env, task, engine, self.c.renderer,
                        self._episode_config(temperature, seed_base + g * group_size + j))
            for g, task in enumerate(tasks) for j in range(group_size)
        ]
        flat = await asyncio.gather(*coros)
        return [list(flat[g * group_size:(g + 1) * group_size]) for g in range(len(tasks))]

    # -- training --------------------------------------------------------------------------

    def build_datums(self, groups: Sequence[Sequence[Trajectory]]) -> tuple[list[Datum], dict[str, float]]:
        rl = self.config.rl
        datums: list[Datum] = []
        kept = constant = 0
        for group in groups:
            valid = [t for t in group if t.error is None]
            rewards = [t.reward for t in valid]
            if rl.remove_constant_reward_groups and is_constant(rewards):
                constant += 1
                continue
            kept += 1
            for trajectory, advantage in zip(valid, group_advantages(rewards, rl.advantage), strict=True):
                datums.extend(trajectory_to_datums(trajectory, float(advantage)))
        action_tokens = sum(float(d.loss_fn_inputs["mask"].data.sum()) for d in datums)
        if datums and action_tokens:
            # Token-level mean (DAPO-style): the losses are token sums, so scale advantages once.
            datums = [_scale_advantages(d, 1.0 / action_tokens) for d in datums]
        return datums, {
            "data/datums": float(len(datums)),
            "data/action_tokens": action_tokens,
            "data/groups_kept": float(kept),
            "data/groups_constant": float(constant),
        }

    def train_on(self, datums: Sequence[Datum]) -> dict[str, float]:
        rl, tc = self.config.rl, self.config.trainer
        trainer = self.c.trainer
        parts = []
        for start in range(0, len(datums), rl.micro_batch_size):
            chunk = datums[start:start + rl.micro_batch_size]
            out = trainer.forward_backward(chunk, rl.loss, rl.loss_config)
            parts.append((out.metrics, len(chunk)))
        step = trainer.optim_step(AdamParams(
            learning_rate=tc.learning_rate, beta1=tc.beta1, beta2=tc.beta2, eps=tc.eps,
            weight_decay=tc.weight_decay, grad_clip_norm=tc.grad_clip_norm,
        ))
        return {**merge_metrics(parts), **{f"optim:{k}": v for k, v in step.metrics.items()}}

    def correct_off_policy(self, datums: Sequence[Datum]) -> tuple[list[Datum], dict[str, float]]:
        """`plait.off_policy.importance_correction` with the trainer's logprobs from one forward
        pass at the weights about to be updated; the data as it is when `off_policy.correction`
        is "none"."""
        if self.config.off_policy.correction == "none" or not datums:
            return list(datums), {}
        rl = self.config.rl
        train_logprobs: list[np.ndarray] = []
        for start in range(0, len(datums), rl.micro_batch_size):
            out = self.c.trainer.forward(datums[start:start + rl.micro_batch_size], rl.loss, rl.loss_config)
            train_logprobs.extend(o["logprobs"].to_numpy() for o in out.loss_fn_outputs)
        return importance_correction(datums, train_logprobs, self.config.off_policy)

    async def sync_weights(self) -> dict[str, float]:
        version = self.c.trainer.weight_version
        stats = await self.c.sync.push(self.c.trainer, self.c.engines, version)
        for index, engine in enumerate(self.c.engines):
            if engine.weight_version != version:
                raise WeightSyncError(
                    f"inference engine #{index} ({type(engine).__name__}) holds weight version "
                    f"{engine.weight_version} after sync method {self.config.sync.method!r} pushed version {version}",
                    fix="pick a sync.method that reaches this engine (in_process or disk for engines in this process)")
        return {"sync/bytes": float(stats.bytes), "sync/seconds": stats.seconds,
                "sync/delta_fraction": stats.delta_fraction, "sync/full_bytes": float(stats.full_bytes)}

    # -- evaluation ------------------------------------------------------------------------

    async def evaluate(self) -> dict[str, float]:
        ec, env_cfg = self.config.eval, self.config.env
        total = await self.c.env.num_tasks(env_cfg.eval_split)
        indices = list(range(min(ec.tasks, total)))
        seed_base = self.config.run.seed * 1_000_003 + 999_983
        greedy = await self.rollout_groups(env_cfg.eval_split, indices, 1, 0.0, seed_base)
        metrics = {"eval/accuracy": mean([float(g[0].correct) for g in greedy]),
                   "eval/reward": mean([g[0].reward for g in greedy]),
                   "eval/errors": float(sum(g[0].error is not None for g in greedy)),
                   "eval/tasks": float(len(indices))}
        if ec.samples_per_task > 1:
            sampled = await self.rollout_groups(env_cfg.eval_split, indices, ec.samples_per_task,
                                                ec.temperature, seed_base + 7)
            rm = rollout_metrics(sampled, prefix="eval")
            metrics.update({k: v for k, v in rm.items() if k.startswith("eval/")})
        return metrics

    # -- one step --------------------------------------------------------------------------

    async def train_step(self, sampler: TaskSampler) -> dict[str, float]:
        rl = self.config.rl
        t0 = time.perf_counter()
        indices = sampler.batch(self.step * rl.groups_per_batch, rl.groups_per_batch)
        seed_base = (self.config.run.seed * 1_000_003 + self.step) * 100_003
        groups = await self.rollout_groups(self.config.env.train_split, indices, rl.group_size,
                                           rl.temperature, seed_base)
        t_rollout = time.perf_counter() - t0
        crash_point("rollout", self.step)
        trajectories = [t for g in groups for t in g]
        metrics = rollout_metrics(groups)
        metrics["time/verify"] = _union_seconds([iv for t in trajectories for iv in t.env_seconds])
        self._write_samples(groups)

        datums, data_metrics = self.build_datums(groups)
        metrics.update(data_metrics)
        t1 = time.perf_counter()
        trained_version = self.c.trainer.weight_version
        datums, correction = self.correct_off_policy(datums)
        train_metrics = self.train_on(datums) if datums else self._skip_optim()
        t_train = time.perf_counter() - t1
        metrics.update(self._policy_metrics(train_metrics, trajectories, t_train))
        metrics.update(correction)
        self.record_trained([
            TrainedSample(self.step * rl.groups_per_batch + g, j, task_index, self.attempt, trajectory)
            for g, (task_index, group) in enumerate(zip(indices, groups, strict=True))
            for j, trajectory in enumerate(group)
        ], trained_version)
        crash_point("trained", self.step)

        t2 = time.perf_counter()
        metrics.update(await self.sync_weights())
        t_sync = time.perf_counter() - t2

        generated = sum(t.completion_tokens for t in trajectories)
        metrics.update({
            "time/rollout": t_rollout, "time/train": t_train, "time/sync": t_sync,
            "time/stall": t_rollout,  # the sync schedule's trainer waits for every rollout
            "perf/tokens_per_s/rollout": generated / t_rollout if t_rollout else 0.0,
            "async/staleness_mean": 0.0, "async/staleness_max": 0.0,
            "progress/samples": float(self.samples_seen + len(trajectories)),
        })
        self.samples_seen += len(trajectories)
        metrics["time/total"] = time.perf_counter() - t0
        return metrics

    def _skip_optim(self) -> dict[str, float]:
        log.info("no learning signal this step (every group had equal rewards); skipping the update",
                 step=self.step)
        return {}

    def _policy_metrics(self, train: dict[str, float], trajectories: Sequence[Trajectory],
                        t_train: float) -> dict[str, float]:
        sampled_lp = [lp for t in trajectories if t.error is None for turn in t.turns for lp in turn.completion.logprobs]
        out: dict[str, float] = {"policy/entropy_sampled": -mean(sampled_lp) if sampled_lp else 0.0}
        renames = {
            "entropy:mean": "policy/entropy",
            "importance_weight:max": "policy/importance_weight_max",
            "importance_weight:mean": "policy/importance_weight_mean",
            "mismatch_kl_k1:mean": "policy/mismatch_kl",
            "mismatch_kl_k2:mean": "policy/mismatch_kl_k2",
            "clip_fraction:mean": "optim/clip_fraction",
            "loss:sum": "optim/loss",
            "optim:grad_norm": "optim/grad_norm",
            "optim:lr": "optim/lr",
        }
        for src, dst in renames.items():
            if src in train:
                out[dst] = train[src]
        out.setdefault("policy/entropy", out["policy/entropy_sampled"])
        tokens = train.get("train_tokens:sum", 0.0)
        if t_train > 0 and tokens:
            out["perf/tokens_per_s/train"] = tokens / t_train
        peak = getattr(self.c.trainer, "peak_flops_per_s", None)
        if peak and t_train > 0 and "model_flops:sum" in train:
            out["perf/mfu"] = train["model_flops:sum"] / t_train / peak
            out["perf/peak_flops"] = float(peak)
        return out

    def _write_samples(self, groups: Sequence[Sequence[Trajectory]], per_step: int = 2) -> None:
        """A few decoded samples per step in samples.jsonl, for reading what the model does."""
        tokenizer = self.c.renderer.tokenizer
        with (self.run_dir / "samples.jsonl").open("a") as f:
            for group in groups[:per_step]:
                t = group[0]
                if not t.turns:
                    continue
                f.write(json.dumps({
                    "step": self.step, "task": t.task, "reward": t.reward, "correct": t.correct,
                    "error": t.error,
                    "completion": [tokenizer.decode(list(turn.completion.tokens)) for turn in t.turns],
                }, default=str) + "\n")

    # -- checkpoints -----------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint holds beside the trainer state (taken in the event loop, so that
        it is consistent; written by `save_checkpoint`, possibly in a thread)."""
        return {"step": self.step, "samples_seen": self.samples_seen, "attempt": self.attempt,
                "weight_version": self.c.trainer.weight_version, "eval_history": self.eval_history}

    def save_checkpoint(self, state: dict[str, Any] | None = None) -> Path:
        """Trainer state and `state` (default: `checkpoint_state()`) under checkpoints/step_N,
        written to a temporary directory, fsynced and renamed into place: a crash at any moment
        leaves the previous checkpoint or this one, complete."""
        state = self.checkpoint_state() if state is None else state
        root = self.run_dir / CHECKPOINT_DIR
        final = root / f"step_{self.step:06d}"
        tmp = root / f".tmp-step_{self.step:06d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.c.trainer.save_state(tmp / "trainer")
        _write_synced(tmp / "controller.json", json.dumps(state))
        _fsync_dir(tmp)
        crash_point("checkpoint", self.step)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(root)
        crash_point("checkpointed", self.step)
        for old in sorted(root.glob("step_*"))[:-self.config.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self) -> bool:
        root = self.run_dir / CHECKPOINT_DIR
        for leftover in root.glob(".tmp-step_*"):  # a save that a crash interrupted
            shutil.rmtree(leftover, ignore_errors=True)
        checkpoints = sorted(root.glob("step_*"))
        if not checkpoints:
            for name in ("metrics.jsonl", LEDGER_FILE):  # leftovers of a run that saved nothing
                _truncate_metrics(self.run_dir / name, -1)
            return False
        latest = checkpoints[-1]
        state = json.loads((latest / "controller.json").read_text())
        self.c.trainer.load_state(latest / "trainer")
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.attempt = int(state.get("attempt", 0)) + 1
        self.eval_history = [tuple(x) for x in state.get("eval_history", [])]
        self.restore_state(state)
        for name in ("metrics.jsonl", LEDGER_FILE):
            _truncate_metrics(self.run_dir / name, self.step)
        log.info("resumed from checkpoint", checkpoint=str(latest), step=self.step, attempt=self.attempt)
        return True

    def restore_state(self, state: dict[str, Any]) -> None:
        """Take back what `checkpoint_state` added (the sync schedule adds nothing)."""

    def record_trained(self, samples: Sequence[TrainedSample], weight_version: int) -> None:
        """Append what this step trained on (at `weight_version`) to trained.jsonl, numbered as
        its metrics (the step count after it); truncated with them on resume, so it lists exactly
        what the checkpointed weights have seen."""
        record = {"step": self.step + 1, "weight_version": weight_version, "attempt": self.attempt,
                  "samples": [s.ledger_entry() for s in samples]}
        with (self.run_dir / LEDGER_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")

    @contextlib.asynccontextmanager
    async def rollouts_in_background(self, sampler: TaskSampler) -> AsyncIterator[None]:
        """The sync schedule samples inside `train_step`; the async one runs a producer here."""
        yield

    # -- the loop --------------------------------------------------------------------------

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})
        for sink in self.c.sinks:
            sink.log(step, metrics)

    async def run(self, *, resume: bool) -> dict[str, Any]:
        from plait.progress import StepProgress

        if resume and self.load_checkpoint() and self.step >= self.config.rl.steps:
            log.info("this run is already complete; pass --no-resume to start it over", steps=self.step)
        await self.sync_weights()  # engines start from exactly the trainer's weights
        rl = self.config.rl
        sampler = TaskSampler(await self.c.env.num_tasks(self.config.env.train_split), self.config.run.seed)
        run_start = time.perf_counter()
        with StepProgress(total=rl.steps, completed=self.step, title=self.config.run.name) as progress:
            if self.step == 0:
                progress.phase("eval")
                self._record_eval(0, await self.evaluate())
            async with self.rollouts_in_background(sampler):
                await self._loop(sampler, progress)
        return self.summary(time.perf_counter() - run_start)

    async def _loop(self, sampler: TaskSampler, progress: Any) -> None:
        rl, ec = self.config.rl, self.config.eval
        while self.step < rl.steps:
            progress.phase("rollout/train")
            metrics = await self.train_step(sampler)
            self.step += 1
            if (ec.every and self.step % ec.every == 0) or self.step == rl.steps:
                progress.phase("eval")
                t_eval = time.perf_counter()
                metrics.update(await self.evaluate())
                metrics["time/eval"] = time.perf_counter() - t_eval
                self.eval_history.append((self.step, metrics["eval/accuracy"]))
            self.log_metrics(self.step, metrics)
            progress.advance(metrics)
            every = self.config.checkpoint.every
            if (every and self.step % every == 0) or self.step == rl.steps:
                progress.phase("checkpoint")
                await asyncio.to_thread(self.save_checkpoint, self.checkpoint_state())

    def _record_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.eval_history.append((step, metrics["eval/accuracy"]))
        self.log_metrics(step, metrics)

    def summary(self, seconds: float) -> dict[str, Any]:
        first = self.eval_history[0][1] if self.eval_history else float("nan")
        last = self.eval_history[-1][1] if self.eval_history else float("nan")
        summary = {
            "run": self.config.run.name, "run_dir": str(self.run_dir), "steps": self.step,
            "seconds": round(seconds, 1), "eval_accuracy_start": first, "eval_accuracy_end": last,
            "eval_accuracy_gain": last - first, "eval_history": self.eval_history,
            "model": self.c.model.name, "env": self.config.env.name,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    async def close(self) -> None:
        close_sync = getattr(self.c.sync, "close", None)  # syncs that hold a group or files
        if close_sync is not None:
            await close_sync()
        for engine in self.c.engines:
            await engine.close()
        self.c.trainer.close()
        await self.c.env.close()
        for sink in self.c.sinks:
            sink.close()


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric records after `step` (written by a run that died after its last checkpoint)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if _record_step(line) <= step]
    path.write_text("".join(line + "\n" for line in kept))


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # torn line: drop it


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@attrs.frozen
class TrainedSample:
    """One sample a step trained on, and where it came from (for the ledger and for resume)."""

    position: int
    """The prompt's place in the run's task order (`TaskSampler`); group g of step s is s * groups_per_batch + g."""
    index: int
    """Its number within the prompt's group."""
    task_index: int
    attempt: int
    """The sampling process's `Controller.attempt`."""
    trajectory: Trajectory

    def ledger_entry(self) -> list[int]:
        tokens = [t for turn in self.trajectory.turns for t in turn.completion.tokens]
        digest = zlib.crc32(json.dumps(tokens).encode())
        return [self.position, self.index, self.task_index, self.attempt, digest]


def _scale_advantages(datum: Datum, factor: float) -> Datum:
    inputs = dict(datum.loss_fn_inputs)
    inputs["advantages"] = inputs["advantages"].to_numpy() * factor
    return Datum(datum.model_input, inputs)


def prepare_run_dir(config: RunConfig, *, resume: bool) -> Path:
    run_dir = Path(config.run.out_dir) / config.run.name
    if run_dir.exists() and not resume:
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    import tomli_w

    (run_dir / "config.toml").write_text(tomli_w.dumps(unstructure(config)))
    return run_dir


def run_training(config: RunConfig, *, config_path: Path | None = None, resume: bool = True) -> str:
    """Build the components, train, plot; return a one-paragraph summary."""
    get_registry()  # load plugins before the (slow) model resolution, so errors come early
    run_dir = prepare_run_dir(config, resume=resume)
    components = build_components(config, run_dir)
    if config.rl.schedule == "async":
        from plait.async_schedule import AsyncController

        controller: Controller = AsyncController(config, components, run_dir)
    else:
        controller = Controller(config, components, run_dir)

    async def main() -> dict[str, Any]:
        try:
            return await controller.run(resume=resume)
        finally:
            await controller.close()

    summary = asyncio.run(main())
    from plait.plot import plot_run

    dashboard = plot_run(run_dir)
    return (
        f"run {summary['run']}: {summary['steps']} steps in {summary['seconds'] / 60:.1f} min; "
        f"held-out accuracy {summary['eval_accuracy_start']:.3f} -> {summary['eval_accuracy_end']:.3f} "
        f"({summary['eval_accuracy_gain']:+.3f}); run dir {run_dir}; dashboard {dashboard}"
    )
