"""The `standard` batch preparer (`rl.batch_preparer`): how one policy's groups of a step become
training data.

Advantages of the whole batch at once (`rl.advantage`; constant-reward groups left out), samples
a length limit cut handled as `rl.overlong` says, each token's loss weighed as
`rl.loss_aggregation` says. With KL in the reward (`rl.kl.where`), the KL to the reference is
taken off the rewards before the estimator sees them (`plait_algorithms.kl`); with the reference
on an inference engine (`rl.kl.reference`), every datum carries its logprobs, which `annotate`
had that engine score as the episode ended (`plait_algorithms.reference`). Then the run's
off-policy correction (`off_policy.correction`, `plait_algorithms.off_policy`). Dynamic sampling
(`rl.dynamic_sampling`) asks `has_signal` of each group it samples; its rounds are the run loop's.
`check`, at config load, refuses the reference attached by url and a critic without an estimator
built on its values (or the reverse).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plait.api import (
    ADVANTAGE,
    AdvantageBatch,
    BatchPreparer,
    Critic,
    DataError,
    Datum,
    InferenceEngine,
    RLSection,
    RunConfig,
    TrainerEngine,
    Trajectory,
    get_registry,
)
from plait_algorithms.critic import (
    action_values,
    check_critic,
    check_critic_config,
    fit_critic,
    whitened,
)
from plait_algorithms.datums import (
    REF_LOGPROBS,
    action_tokens,
    on_action_tokens,
    trajectory_to_datums,
)
from plait_algorithms.kl import kl_penalties
from plait_algorithms.off_policy import corrected
from plait_algorithms.reference import (
    check_reference,
    check_reference_logprobs,
    with_reference,
)


class Standard:
    """The `standard` batch preparer (`plait.api.BatchPreparer`): this module's functions."""

    def prepare(
        self,
        config: RunConfig,
        groups: Sequence[Sequence[Trajectory]],
        trainer: TrainerEngine | None = None,
        critic: Critic | None = None,
    ) -> tuple[list[Datum], dict[str, float]]:
        return prepare(config, groups, trainer, critic)

    def has_signal(self, rl: RLSection, group: Sequence[Trajectory]) -> bool:
        return has_signal(rl, group)

    def check(self, config: RunConfig) -> None:
        check_reference(config)
        check_critic_config(config)

    async def annotate(
        self,
        config: RunConfig,
        trajectory: Trajectory,
        references: Sequence[InferenceEngine | None],
    ) -> Trajectory:
        return await with_reference(config, trajectory, references)


standard: BatchPreparer = Standard()


def prepare(
    config: RunConfig,
    groups: Sequence[Sequence[Trajectory]],
    trainer: TrainerEngine | None = None,
    critic: Critic | None = None,
) -> tuple[list[Datum], dict[str, float]]:
    """One policy's groups as datums with advantages on their action tokens, corrected for
    off-policy sampling with `trainer` (the policy's), and the batch's `data/*` metrics; with a
    critic, its values go to the estimator and it is fit to the returns
    (`plait_algorithms.critic`), with its `critic/*` metrics; with KL in the reward, the KL to the
    reference is taken off the rewards first (`plait_algorithms.kl`)."""
    rl = config.rl
    samples: list[list[list[Datum]]] = []  # per group and sample, its datums
    batch_rewards: list[np.ndarray] = []
    trains: list[list[bool]] = []  # per group and sample, False where rl.overlong masks it
    kept = constant = 0
    for group in groups:
        valid = [t for t in group if t.error is None]
        if (rl.remove_constant_reward_groups or rl.dynamic_sampling) and not has_signal(rl, valid):
            constant += 1
            continue
        kept += 1
        if valid:  # advantages go in once the estimator has seen the whole batch
            samples.append([trajectory_to_datums(t, 0.0) for t in valid])
            batch_rewards.append(sample_rewards(rl, valid))
            trains.append([rl.overlong != "mask" or not overlong(t) for t in valid])
    if config.rl.kl.on_engine:
        check_reference_logprobs(samples)
    kl_metrics: dict[str, float] = {}
    if rl.kl.coef and rl.kl.where == "reward" and samples:
        penalties, kl_metrics = kl_penalties(trainer, rl, samples)
        batch_rewards = [r - p for r, p in zip(batch_rewards, penalties, strict=True)]
        # trained on, they would have the trainer report its own KL as policy/kl_ref
        samples = [[[_without(REF_LOGPROBS, d) for d in s] for s in g] for g in samples]
    counts = [np.asarray([action_tokens(s) for s in group], dtype=np.int64) for group in samples]
    estimator = get_registry().get(ADVANTAGE, rl.advantage)
    options = estimator.validate_options(rl.advantage_options, "rl.advantage_options")
    estimate = estimator.load()
    if critic is not None:
        check_critic(critic)
    values = action_values(critic, rl, samples) if critic and samples else None
    batch = AdvantageBatch(batch_rewards, counts, values)
    advantages = estimate(batch, options=options) if samples else []
    _check_counts(advantages, counts)
    fitted = fit_critic(critic, rl, samples, values, advantages) if critic and values else None
    if fitted is not None:
        advantages = whitened(advantages)
    trained = [  # masked samples count in their group's advantages (as in TRL), and only there
        (sample, sample_advantages)
        for group, group_advantages, group_trains in zip(samples, advantages, trains, strict=True)
        for sample, sample_advantages, t in zip(group, group_advantages, group_trains, strict=True)
        if t
    ]
    tokens = [action_tokens(sample) for sample, _ in trained]
    scales = aggregation_scales(rl.loss_aggregation, tokens)
    datums = [
        datum
        for (sample, sample_advantages), scale in zip(trained, scales, strict=True)
        for datum in _with_advantages(sample, sample_advantages, scale)
    ]
    datums, correction = corrected(config, trainer, datums)
    metrics = {
        **(fitted or {}),
        **correction,
        **kl_metrics,
        "data/datums": float(len(datums)),
        "data/action_tokens": float(sum(tokens)),
        "data/groups_kept": float(kept),
        "data/groups_constant": float(constant),
    }
    valid = [t for group in groups for t in group if t.error is None]
    metrics["data/overlong"] = _mean([float(overlong(t)) for t in valid])  # of the whole batch
    if rl.overlong == "mask":
        metrics["data/overlong_masked"] = sum(len(g) - sum(g) for g in trains) / max(len(valid), 1)
    if rl.overlong == "penalty":
        penalised = sum(r < t.reward for r, t in zip(sample_rewards(rl, valid), valid, strict=True))
        metrics["data/overlong_penalised"] = penalised / max(len(valid), 1)
    return datums, metrics


def overlong(t: Trajectory) -> bool:
    """Cut by a length limit: a response stopped at `rl.max_tokens` (or at what
    `rl.max_episode_tokens` left it)."""
    return any(turn.completion.stop_reason == "length" for turn in t.turns)


def sample_rewards(rl: RLSection, valid: Sequence[Trajectory]) -> np.ndarray:
    """What advantages start from: each episode's reward, plus DAPO's soft overlong punishment
    of its longest response with `rl.overlong = "penalty"`."""
    rewards = np.asarray([t.reward for t in valid], dtype=np.float64)
    if rl.overlong == "penalty":
        expected, buffer = rl.max_tokens - rl.overlong_buffer, rl.overlong_buffer
        longest = [max((len(u.completion.tokens) for u in t.turns), default=0) for t in valid]
        rewards += [
            -1.0 if overlong(t) else max(-1.0, min(0.0, (expected - n) / buffer))
            for t, n in zip(valid, longest, strict=True)
        ]
    return rewards


def has_signal(rl: RLSection, group: Sequence[Trajectory]) -> bool:
    """Whether the rewards of the group's episodes that did not fail differ (after the overlong
    penalty, with `rl.overlong = "penalty"`)."""
    rewards = sample_rewards(rl, [t for t in group if t.error is None])
    return rewards.size > 0 and np.ptp(rewards) > 0


def aggregation_scales(how: str, tokens: Sequence[int]) -> list[float]:
    """The weight of each trained sample's tokens (`rl.loss_aggregation`), from every trained
    sample's action tokens."""
    samples = max(len(tokens), 1)
    if how == "sequence_mean":
        return [1.0 / (max(n, 1) * samples) for n in tokens]
    if how == "sequence_sum":
        return [1.0 / samples for _ in tokens]
    return [1.0 / max(float(sum(tokens)), 1.0) for _ in tokens]  # token_mean


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0  # as plait's metrics average


def _with_advantages(datums: Sequence[Datum], advantages: np.ndarray, scale: float) -> list[Datum]:
    """One sample's datums with `advantages` (one per action token, across the datums in order)
    on their action tokens, times `scale`."""
    return [
        Datum(datum.model_input, {**datum.loss_fn_inputs, "advantages": placed * scale})
        for datum, placed in zip(datums, on_action_tokens(datums, advantages), strict=True)
    ]


def _check_counts(advantages: Sequence[Sequence[np.ndarray]], counts: Sequence[np.ndarray]) -> None:
    """The estimator gave one advantage per action token of every sample."""
    for group_advantages, group_counts in zip(advantages, counts, strict=True):
        for sample_advantages, n in zip(group_advantages, group_counts, strict=True):
            if len(sample_advantages) != n:
                raise DataError(
                    f"the advantage estimator (rl.advantage) gave {len(sample_advantages)} "
                    f"advantages to a sample of {n} action tokens",
                    fix="return one advantage per action token of each sample (the batch's "
                    "action_tokens)",
                )


def _without(key: str, datum: Datum) -> Datum:
    """`datum` without the loss input `key`."""
    inputs = {k: v for k, v in datum.loss_fn_inputs.items() if k != key}
    return Datum(datum.model_input, inputs)
