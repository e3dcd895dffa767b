"""plait-algorithms' plugin module: its batch preparer, advantage estimators, off-policy
corrections, the `judge` environment (rewards from a model) by lazy targets, and the
`plait reward-model` commands."""

from __future__ import annotations

import click

from plait.api import (
    RegisterAdvantage,
    RegisterBatchPreparer,
    RegisterEnv,
    RegisterOffPolicyCorrection,
    hookimpl,
)


@hookimpl
def plait_register_batch_preparers(register: RegisterBatchPreparer) -> None:
    register(
        "standard",
        "plait_algorithms.batch:standard",
        description="constant groups out, rl.overlong, rl.advantage, rl.loss_aggregation",
    )


@hookimpl
def plait_register_advantages(register: RegisterAdvantage) -> None:
    register("grpo", "plait_algorithms.advantages:grpo", description="(r - mean) / std")
    register("dr_grpo", "plait_algorithms.advantages:dr_grpo", description="r - mean")
    register("rloo", "plait_algorithms.advantages:rloo", description="leave-one-out baseline")
    register(
        "reinforce++",
        "plait_algorithms.advantages:reinforce_pp",
        description="REINFORCE++: r normalised over the batch's tokens",
    )
    register(
        "reinforce++_baseline",
        "plait_algorithms.advantages:reinforce_pp_baseline",
        description="r - group mean, normalised over the batch's tokens",
    )
    register(
        "gae",
        "plait_algorithms.advantages:gae",
        options="plait_algorithms.advantages:GaeOptions",
        description="generalised advantage estimation from a critic's values (gamma, lam)",
    )


@hookimpl
def plait_register_off_policy_corrections(register: RegisterOffPolicyCorrection) -> None:
    register(
        "token",
        "plait_algorithms.off_policy:token",
        description="truncated importance weight per sampled token",
    )
    register(
        "sequence",
        "plait_algorithms.off_policy:sequence",
        description="truncated importance weight per sequence (product of its tokens')",
    )


@hookimpl
def plait_register_envs(register: RegisterEnv) -> None:
    register(
        "judge",
        "plait_algorithms.judge:make_judge",
        options="plait_algorithms.judge:JudgeOptions",
        description="any environment's episodes graded again by a model against a rubric, or "
        "by a reward model (options: env, env_options, rubric, scale, env_weight, judge_weight, "
        "grader, reward_model)",
    )


@hookimpl
def plait_register_commands(cli: click.Group) -> None:
    from plait_algorithms.cli import reward_model_commands

    cli.add_command(reward_model_commands)
