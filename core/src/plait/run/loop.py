"""The run, top to bottom: build the components, then every step

    batch (the schedule's) -> prepare -> train -> record -> publish -> metrics
    [evaluate] [checkpoint]

and evaluate on held-out tasks before the first step and every `eval.every` steps.
"""

from __future__ import annotations

import asyncio
import gc
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
import tomli_w

from plait.components import Components, Policy, build_components, validate_components
from plait.config import RunConfig
from plait.metrics import MetricSink, ShowsProgress
from plait.protocols import ClosableWeightSync
from plait.run.checkpoint import (
    checkpoint_state,
    crash_point,
    load_checkpoint,
    record_trained,
    save_checkpoint,
)
from plait.run.report import StepTimes, policy_metrics, step_metrics
from plait.run.schedules import Schedule, make_schedule
from plait.run.state import Run, RunState, TaskSampler
from plait.run.steps import (
    check_failures,
    evaluate_held_out,
    policy_groups,
    prepare_groups,
    publish,
    train_prepared,
    write_samples,
)
from plait.schema import unstructure
from plait.trajectory import Trajectory

log = structlog.get_logger("plait.run")


async def train_step(run: Run, schedule: Schedule) -> dict[str, float]:
    """One step of either schedule; returns its metrics."""
    step = run.state.step
    policies = run.components.policies
    t0 = time.perf_counter()
    batch, rollout_seconds = await schedule.batch(step)
    stall = time.perf_counter() - t0
    groups = [[s.trajectory for s in group] for group in batch]
    check_failures(groups, run.config.rl.max_failed_fraction, step, run.config.env.name)
    write_samples(run, groups)

    trained_version = policies[0].trainer.weight_version
    t1 = time.perf_counter()
    trained = await asyncio.gather(*(train_policy(run, schedule, p, groups) for p in policies))
    train_seconds = time.perf_counter() - t1
    samples = [s for group in batch for s in group]
    record_trained(run, samples, trained_version)
    crash_point("trained", step)

    t2 = time.perf_counter()
    synced = await schedule.publish(step)
    sync_seconds = time.perf_counter() - t2

    metrics = step_metrics(
        groups,
        trained,
        times=StepTimes(
            rollout=rollout_seconds,
            stall=stall,
            train=train_seconds,
            sync=sync_seconds,
            total=time.perf_counter() - t0,
        ),
        schedule={**synced, **schedule.done(step)},
        samples_before=run.state.samples_seen,
        restored=sum(s.attempt != run.state.attempt for s in samples),
    )
    run.state.samples_seen += len(samples)
    return metrics


async def train_policy(
    run: Run, schedule: Schedule, policy: Policy, groups: list[list[Trajectory]]
) -> dict[str, float]:
    """Prepare and train one policy on what it played of the batch; its metrics."""
    views = policy_groups(run.components, policy, groups)
    version = policy.trainer.weight_version
    start = time.perf_counter()
    critic = run.components.critic
    datums, prepared = await schedule.compute(
        lambda: prepare_groups(run.config, policy, views, critic)
    )
    trained = await schedule.compute(
        lambda: train_prepared(run.config.rl, policy, datums, always_step=schedule.always_step)
    )
    return run.components.suffixed(
        policy,
        policy_metrics(
            views,
            prepared=prepared,
            trained=trained,
            trainer=policy.trainer,
            trained_version=version,
            train_seconds=time.perf_counter() - start,
        ),
    )


def log_metrics(sinks: Sequence[MetricSink], step: int, metrics: dict[str, float]) -> None:
    for sink in sinks:
        sink.log(step, metrics)


def show_phase(run: Run, name: str) -> None:
    for sink in run.components.sinks:
        if isinstance(sink, ShowsProgress):
            sink.phase(run.state.step, name)


async def run_loop(run: Run, schedule: Schedule, *, resume: bool) -> dict[str, Any]:
    rl, ec, state = run.config.rl, run.config.eval, run.state
    if resume:
        held = load_checkpoint(run)
        if held is not None:
            schedule.restore(held)
            if state.step >= rl.steps:
                log.info(
                    "this run is already complete; pass --no-resume to start it over",
                    steps=state.step,
                )
    await publish(run.components)  # engines start from exactly the trainer's weights
    run_start = time.perf_counter()
    if state.step == 0:
        show_phase(run, "eval")
        metrics = await evaluate_held_out(run.config, run.components)
        state.eval_history.append((0, metrics["eval/accuracy"]))
        log_metrics(run.components.sinks, 0, metrics)
    async with schedule.running():
        while state.step < rl.steps:
            show_phase(run, "rollout/train")
            metrics = await train_step(run, schedule)
            state.step += 1
            if (ec.every and state.step % ec.every == 0) or state.step == rl.steps:
                show_phase(run, "eval")
                t_eval = time.perf_counter()
                metrics.update(await evaluate_held_out(run.config, run.components))
                metrics["time/eval"] = time.perf_counter() - t_eval
                state.eval_history.append((state.step, metrics["eval/accuracy"]))
            log_metrics(run.components.sinks, state.step, metrics)
            every = run.config.checkpoint.every
            if (every and state.step % every == 0) or state.step == rl.steps:
                show_phase(run, "checkpoint")
                await asyncio.to_thread(
                    save_checkpoint, run, checkpoint_state(run, schedule.held())
                )
    return summarize(run, time.perf_counter() - run_start)


def summarize(run: Run, seconds: float) -> dict[str, Any]:
    history = run.state.eval_history
    first, last = (history[0][1], history[-1][1]) if history else (float("nan"), float("nan"))
    summary = {
        "run": run.config.run.name,
        "run_dir": str(run.run_dir),
        "steps": run.state.step,
        "seconds": round(seconds, 1),
        "eval_accuracy_start": first,
        "eval_accuracy_end": last,
        "eval_accuracy_gain": last - first,
        "eval_history": history,
        "model": run.components.policies[0].model.name,
        "env": run.config.env.name,
    }
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


async def close_components(c: Components) -> None:
    for policy in c.policies:
        if isinstance(policy.sync, ClosableWeightSync):  # syncs that hold a group or files
            await policy.sync.close()
        for engine in [*policy.engines, policy.reference]:
            if engine is not None:  # the reference exists with rl.kl.reference = "inference"
                await engine.close()
        policy.trainer.close()
    if c.critic is not None:
        c.critic.trainer.close()
    await c.env.close()
    for sink in c.sinks:
        sink.close()


def prepare_run_dir(config: RunConfig, *, resume: bool) -> Path:
    run_dir = Path(config.run.out_dir) / config.run.name
    if run_dir.exists() and not resume:
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(tomli_w.dumps(unstructure(config)))
    return run_dir


def run_training(config: RunConfig, *, resume: bool = True) -> str:
    """Build the components and train; return a one-paragraph summary."""
    validate_components(config)  # before the (slow) model resolution, so errors come early
    run_dir = prepare_run_dir(config, resume=resume)
    components = build_components(config, run_dir)
    # loaded for the whole run: full collections walked it, stalling every thread ~0.25 s
    gc.freeze()

    async def main() -> dict[str, Any]:
        try:
            sampler = TaskSampler(
                await components.env.num_tasks(config.env.train_split), config.run.seed
            )
            run = Run(config, components, run_dir, RunState(), sampler)
            return await run_loop(run, make_schedule(run), resume=resume)
        finally:
            await close_components(components)

    summary = asyncio.run(main())
    return (
        f"run {summary['run']}: {summary['steps']} steps in {summary['seconds'] / 60:.1f} min; "
        f"held-out accuracy {summary['eval_accuracy_start']:.3f} -> "
        f"{summary['eval_accuracy_end']:.3f} "
        f"({summary['eval_accuracy_gain']:+.3f}); run dir {run_dir}"
    )
