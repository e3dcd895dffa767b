"""Advantage estimators, registered as the `advantage` components (`rl.advantage`).

Each takes the step's whole batch (`plait.api.AdvantageBatch`: per group, each sample's reward and
action-token count, and the critic's per-token values where there is a critic) and returns, per
group and sample, one advantage per action token, in the order of the sample's turns.

- group-relative, one advantage for all of a sample's tokens: `grpo`, `dr_grpo`, `rloo` (a group
  whose rewards are all equal gets zeros);
- normalised over the whole batch: `reinforce_pp` (registered as "reinforce++") and
  `reinforce_pp_baseline` ("reinforce++_baseline");
- from a critic: `gae` (options `GaeOptions`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np

from plait.api import AdvantageBatch, ConfigError

EPS = 1e-6
F = TypeVar("F", bound=Callable[..., Any])


def per_token(batch: AdvantageBatch, advantages: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
    """Per group, each sample's one advantage (`advantages[group][sample]`) repeated over its
    action tokens: how an estimator with one advantage per sample answers."""
    return [
        [np.full(n, a, dtype=np.float64) for a, n in zip(group, counts, strict=True)]
        for group, counts in zip(advantages, batch.action_tokens, strict=True)
    ]


def grpo(batch: AdvantageBatch, *, options: None = None) -> list[list[np.ndarray]]:
    """(r - mean) / (std + eps) within each group, DeepSeekMath's GRPO."""
    return per_token(batch, [(r - r.mean()) / (r.std() + EPS) for r in batch.rewards])


def dr_grpo(batch: AdvantageBatch, *, options: None = None) -> list[list[np.ndarray]]:
    """r - the group's mean: Dr. GRPO (no std scaling; also the tinker-cookbook default)."""
    return per_token(batch, [r - r.mean() for r in batch.rewards])


def rloo(batch: AdvantageBatch, *, options: None = None) -> list[list[np.ndarray]]:
    """r - the mean of the *other* samples of the group (REINFORCE leave-one-out)."""
    return per_token(
        batch,
        [
            (r - r.mean()) * r.size / (r.size - 1) if r.size > 1 else np.zeros_like(r)
            for r in batch.rewards
        ],
    )


def reinforce_pp(batch: AdvantageBatch, *, options: None = None) -> list[list[np.ndarray]]:
    """REINFORCE++ (Hu 2025): every action token's return is its sample's reward (the reward
    comes at the last token, undiscounted), normalised over all the batch's action tokens."""
    return per_token(batch, _normalised_over_tokens(batch, batch.rewards))


def reinforce_pp_baseline(batch: AdvantageBatch, *, options: None = None) -> list[list[np.ndarray]]:
    """REINFORCE++ with a baseline (verl's reinforce_plus_plus_baseline): the group's mean reward
    subtracted, then normalised over all the batch's action tokens."""
    return per_token(batch, _normalised_over_tokens(batch, [r - r.mean() for r in batch.rewards]))


def _normalised_over_tokens(
    batch: AdvantageBatch, scores: Sequence[np.ndarray]
) -> list[np.ndarray]:
    """Each group's per-sample `scores` as (score - mean) / (std + eps), with mean and std over
    every action token of the batch (a sample weighs as many tokens as it has)."""
    tokens = np.repeat(np.concatenate(scores), np.concatenate(batch.action_tokens))
    if not tokens.size:
        return [np.zeros_like(s) for s in scores]
    return [(s - tokens.mean()) / (tokens.std() + EPS) for s in scores]


def _unit_interval(_inst: object, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1], got {value}")


@attrs.frozen
class GaeOptions:
    gamma: float = attrs.field(default=1.0, validator=_unit_interval)
    """Discount per action token."""
    lam: float = attrs.field(default=1.0, validator=_unit_interval)
    """GAE's lambda: 1 gives the discounted return minus the value, 0 the one-step TD error."""


def uses_values(estimator: F) -> F:
    """Marks an estimator built on a critic's values (the `standard` preparer fits a run's critic
    to advantage + value, which is a return only for such an estimator)."""
    estimator.uses_values = True  # type: ignore[attr-defined]
    return estimator


def without_critic(advantage: str) -> ConfigError:
    """The error of an estimator built on a critic's values in a run without a critic."""
    return ConfigError(
        "rl.advantage",
        f"{advantage} needs a critic's values of every action token, and this run has no critic",
        fix="give the run a value model ([critic], docs/algorithms.md), or choose an "
        "estimator without one: grpo, dr_grpo, rloo, reinforce++ or reinforce++_baseline",
    )


@uses_values
def gae(batch: AdvantageBatch, *, options: GaeOptions) -> list[list[np.ndarray]]:
    """Generalised advantage estimation (Schulman et al. 2016) over each sample's action tokens,
    across its turns in order (the tokens between turns are not steps): the reward at its last
    action token, the critic's value at each, and 0 after the last."""
    if batch.values is None:
        raise without_critic("gae")
    return [
        [
            _gae(float(reward), np.asarray(values, dtype=np.float64), options)
            for reward, values in zip(rewards, group_values, strict=True)
        ]
        for rewards, group_values in zip(batch.rewards, batch.values, strict=True)
    ]


def _gae(reward: float, values: np.ndarray, options: GaeOptions) -> np.ndarray:
    """A_t = delta_t + gamma lam A_t+1, with delta_t = r_t + gamma V_t+1 - V_t."""
    advantages = np.zeros_like(values)
    next_value = next_advantage = 0.0
    for t in reversed(range(values.size)):
        step_reward = reward if t == values.size - 1 else 0.0
        delta = step_reward + options.gamma * next_value - values[t]
        next_advantage = delta + options.gamma * options.lam * next_advantage
        advantages[t] = next_advantage
        next_value = values[t]
    return advantages
