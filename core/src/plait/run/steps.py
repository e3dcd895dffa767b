"""The steps of the RL loop, as free functions of what each uses (a config section, the
components, a policy); only collecting a step's batch takes the `Run`, whose task order it walks:

    collect -> prepare -> train -> publish        (every step)
    evaluate                                      (every `eval.every` steps)

Collecting differs by schedule (the sync one samples the step's batch when it is due, the async
one has sampled it ahead); everything else is the same code for both (see `plait.run.schedules`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog

from plait import kinds
from plait.components import Components, Policy
from plait.config import RLSection, RunConfig, TrainerSection
from plait.errors import EnvironmentError_, WeightSyncError
from plait.metrics import mean, merge_metrics
from plait.plugins import get_registry
from plait.protocols import TrainerEngine
from plait.rollout import EpisodeConfig, run_episode
from plait.run.report import rollout_metrics
from plait.run.state import EVAL_GREEDY, EVAL_SAMPLED, Batch, Run, TrainedSample, sample_seed
from plait.trajectory import Trajectory
from plait.types import Datum, SamplingParams

log = structlog.get_logger("plait.run")
T = TypeVar("T")


def episode_config(rl: RLSection, temperature: float, seed: int) -> EpisodeConfig:
    sampling = SamplingParams(
        max_tokens=rl.max_tokens, temperature=temperature, top_p=rl.top_p, top_k=rl.top_k, seed=seed
    )
    return EpisodeConfig(
        sampling=sampling,
        max_turns=rl.max_turns,
        reward_reduce=rl.reward_reduce,
        env_timeout_s=rl.env_timeout_s,
        max_episode_tokens=rl.max_episode_tokens,
    )


async def all_or_none(episodes: Sequence[Awaitable[T]]) -> list[T]:
    """Every result, or the first failure with the others cancelled: an episode raises only for
    a failure of the run's own (engine, renderer), which stops the run, so the rest must not go
    on sampling from an engine about to close."""
    tasks = [asyncio.ensure_future(e) for e in episodes]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def sample_groups(
    config: RunConfig,
    c: Components,
    split: str,
    task_indices: Sequence[int],
    group_size: int,
    temperature: float,
    seed: Callable[[int, int], int],
    *,
    train: bool = False,
) -> list[list[Trajectory]]:
    """`group_size` episodes on each task, all running concurrently (the engine batches them);
    `seed(group, index)` seeds each. `train`: episodes to train on, each annotated by the batch
    preparer as it ends, so that what it asks of other engines runs beside the sampling."""
    tasks = await asyncio.gather(*(c.env.get_task(split, i) for i in task_indices))
    preparer = get_registry().get(kinds.BATCH_PREPARER, config.rl.batch_preparer).load()

    async def episode(task: dict[str, Any], config_: EpisodeConfig) -> Trajectory:
        trajectory = await run_episode(c.env, task, *c.policies[0].actor, config_, c.roles())
        if not train or trajectory.error is not None:
            return trajectory  # a failed episode trains on nothing
        players = [next(p for p in c.policies if c.plays(p, t.role)) for t in trajectory.turns]
        return await preparer.annotate(config, trajectory, [p.reference for p in players])

    flat = await all_or_none(
        [
            episode(task, episode_config(config.rl, temperature, seed(g, j)))
            for g, task in enumerate(tasks)
            for j in range(group_size)
        ]
    )
    return [list(flat[g * group_size : (g + 1) * group_size]) for g in range(len(tasks))]


async def collect(run: Run, step: int) -> tuple[Batch, dict[str, float]]:
    """Sample `step`'s batch now: every prompt of the step, `group_size` times. With
    `rl.dynamic_sampling`, groups whose rewards are all equal are made up for by groups of the
    next prompts in task order, round after round, until `groups_per_batch` groups have unequal
    rewards or `rl.max_sampling_rounds` rounds have run. The batch holds every group sampled
    (`prepare_groups` leaves the equal ones out); the metrics say how the sampling went."""
    rl = run.config.rl
    start, missing, rounds = run.positions(step).start, rl.groups_per_batch, 0
    preparer = get_registry().get(kinds.BATCH_PREPARER, rl.batch_preparer).load()
    batch: Batch = []
    while missing and rounds < rl.max_sampling_rounds:
        groups = await sample_positions(
            run, range(start + len(batch), start + len(batch) + missing)
        )
        batch, rounds = batch + groups, rounds + 1
        signal = sum(preparer.has_signal(rl, [s.trajectory for s in group]) for group in groups)
        missing = missing - signal if rl.dynamic_sampling else 0
    if not rl.dynamic_sampling:
        return batch, {}
    run.state.extra_prompts += len(batch) - rl.groups_per_batch
    return batch, {
        "data/sampling_rounds": float(rounds),
        "data/resampled_groups": float(len(batch) - rl.groups_per_batch),
        "data/sampling_capped": float(missing > 0),  # so the step trains on fewer groups
    }


async def sample_positions(run: Run, positions: range) -> Batch:
    """`group_size` samples of the prompt at each of `positions` of the run's task order."""
    rl = run.config.rl
    indices = [run.sampler.index(p) for p in positions]
    groups = await sample_groups(
        run.config,
        run.components,
        run.config.env.train_split,
        indices,
        rl.group_size,
        rl.temperature,
        lambda g, j: run.seed(positions[g], j),
        train=True,
    )
    return [
        [
            TrainedSample(position, j, task_index, run.state.attempt, trajectory)
            for j, trajectory in enumerate(group)
        ]
        for position, task_index, group in zip(positions, indices, groups, strict=True)
    ]


def check_failures(
    groups: Sequence[Sequence[Trajectory]], max_fraction: float, step: int, env: str
) -> None:
    """Stop the run when the environment failed all the step's episodes, or over `max_fraction`."""
    episodes = [t for g in groups for t in g]
    failed = [t for t in episodes if t.error is not None]
    if failed and (len(failed) == len(episodes) or len(failed) > max_fraction * len(episodes)):
        raise EnvironmentError_(
            f"environment {env!r} failed {len(failed)} of the {len(episodes)} episodes of step "
            f"{step}, more than rl.max_failed_fraction = {max_fraction:g}; the first: "
            f"{failed[0].error}",
            fix="fix the environment (its errors are logged above) and run again: `plait run` "
            "resumes from the last checkpoint",
        )


def policy_groups(
    c: Components, policy: Policy, groups: Sequence[Sequence[Trajectory]]
) -> list[list[Trajectory]]:
    """What `policy` learns from: per group and role it plays, the episodes in which that role
    acted, each as that role saw it (`Trajectory.for_role`); the groups as they are in an
    environment without roles."""
    views = []
    for group in groups:
        for role in dict.fromkeys(r for t in group for r in t.acting_roles()):
            if c.plays(policy, role):
                views.append([t.for_role(role) for t in group if role in t.acting_roles()])
    return views


def prepare_groups(
    config: RunConfig,
    policy: Policy,
    groups: Sequence[Sequence[Trajectory]],
    critic: kinds.Critic | None = None,
) -> tuple[list[Datum], dict[str, float]]:
    """One policy's groups as datums with advantages, corrected for off-policy sampling, and
    their metrics (`rl.batch_preparer`; see `plait.kinds.BatchPreparer`)."""
    preparer = get_registry().get(kinds.BATCH_PREPARER, config.rl.batch_preparer).load()
    return preparer.prepare(config, groups, policy.trainer, critic)


def train_prepared(
    rl: RLSection, policy: Policy, datums: Sequence[Datum], *, always_step: bool
) -> dict[str, float]:
    """forward_backward over micro-batches, then one optimizer step. Without data the step is
    skipped unless `always_step` (the async schedule counts on one version per step)."""
    if not datums and not always_step:
        log.info(
            "no learning signal this step (every group had equal rewards); skipping the update",
            weight_version=policy.trainer.weight_version,
            policy=policy.name,
        )
        return {}
    tc = policy.config.trainer
    return train(policy.trainer, tc, rl.loss, rl.train_loss_config, datums, rl.micro_batch_size)


def train(
    trainer: TrainerEngine,
    tc: TrainerSection,
    loss: str,
    loss_config: dict[str, float],
    datums: Sequence[Datum],
    micro_batch_size: int,
) -> dict[str, float]:
    """One training step of `trainer`: forward_backward over micro-batches, then optim_step."""
    parts = []
    for start in range(0, len(datums), micro_batch_size):
        chunk = datums[start : start + micro_batch_size]
        out = trainer.forward_backward(chunk, loss, loss_config)
        parts.append((out.metrics, len(chunk)))
    step = trainer.optim_step(tc.adam)
    return {**merge_metrics(parts), **{f"optim:{k}": v for k, v in step.metrics.items()}}


async def publish(c: Components) -> dict[str, float]:
    """Push each policy's trainer weights to its inference engines, and check that each took
    them."""
    parts = await asyncio.gather(*(publish_policy(c, p) for p in c.policies))
    return {k: v for part in parts for k, v in part.items()}


async def publish_policy(c: Components, policy: Policy) -> dict[str, float]:
    version = policy.trainer.weight_version
    stats = await policy.sync.push(policy.trainer, policy.engines, version)
    for index, engine in enumerate(policy.engines):
        if engine.weight_version != version:
            raise WeightSyncError(
                f"inference engine #{index} ({type(engine).__name__}) of policy "
                f"{policy.name!r} holds weight version {engine.weight_version} after sync "
                f"method {policy.config.sync.method!r} pushed version {version}",
                fix="pick a sync.method that reaches this engine "
                "(in_process or disk for engines in this process)",
            )
    return c.suffixed(
        policy,
        {
            "sync/bytes": float(stats.bytes),
            "sync/seconds": stats.seconds,
            "sync/delta_fraction": stats.delta_fraction,
            "sync/full_bytes": float(stats.full_bytes),
        },
    )


async def evaluate_held_out(config: RunConfig, c: Components) -> dict[str, float]:
    """Greedy accuracy on the first `eval.tasks` held-out tasks; pass@k from sampled answers
    when `eval.samples_per_task` > 1."""
    ec, split, seed = config.eval, config.env.eval_split, config.run.seed
    indices = list(range(min(ec.tasks, await c.env.num_tasks(split))))
    greedy = await sample_groups(
        config, c, split, indices, 1, 0.0, lambda g, _j: sample_seed(seed, EVAL_GREEDY, g)
    )
    metrics = {
        "eval/accuracy": mean([float(g[0].correct) for g in greedy]),
        "eval/reward": mean([g[0].reward for g in greedy]),
        "eval/errors": float(sum(g[0].error is not None for g in greedy)),
        "eval/tasks": float(len(indices)),
    }
    if len(c.policies) > 1:  # and each policy's, over the roles it plays
        for policy in c.policies:
            views = [t for g in policy_groups(c, policy, greedy) for t in g if t.error is None]
            metrics.update(
                c.suffixed(
                    policy,
                    {
                        "eval/accuracy": mean([float(t.correct) for t in views]),
                        "eval/reward": mean([t.reward for t in views]),
                    },
                )
            )
    if ec.samples_per_task > 1:
        k = ec.samples_per_task
        sampled = await sample_groups(
            config,
            c,
            split,
            indices,
            k,
            ec.temperature,
            lambda g, j: sample_seed(seed, EVAL_SAMPLED, g * k + j),
        )
        metrics.update(
            {
                key: v
                for key, v in rollout_metrics(sampled, prefix="eval").items()
                if key.startswith("eval/")
            }
        )
    return metrics


def write_samples(run: Run, groups: Sequence[Sequence[Trajectory]], per_step: int = 2) -> None:
    """A few decoded samples per step in samples.jsonl, for reading what the model does."""
    c = run.components
    with (run.run_dir / "samples.jsonl").open("a") as f:
        for t in (group[0] for group in groups[:per_step]):
            if not t.turns:
                continue
            players = {r: next(p for p in c.policies if c.plays(p, r)) for r in t.acting_roles()}
            completions = [
                players[turn.role].renderer.tokenizer.decode(list(turn.completion.tokens))
                for turn in t.turns
            ]
            sample = {"step": run.state.step, "task": t.task, "reward": t.reward}
            sample |= {"correct": t.correct, "error": t.error, "completion": completions}
            if t.role_rewards:
                sample |= {"roles": [turn.role for turn in t.turns], "role_rewards": t.role_rewards}
            f.write(json.dumps(sample, default=str) + "\n")
