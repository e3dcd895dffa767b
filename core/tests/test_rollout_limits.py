"""The pure parts of multi-turn rollouts: reward reduction, the context budget, trajectory counts.
(Episodes themselves run against real engines in tests/test_multiturn_tito.py.)"""

from __future__ import annotations

import pytest

from plait.rollout import EpisodeConfig, reduce_rewards, sampling_within_budget
from plait.trajectory import Trajectory, Turn
from plait.types import SampledSequence, SamplingParams


@pytest.mark.parametrize(
    ("rule", "expected"), [("sum", 1.5), ("last", 0.0), ("max", 1.0), ("mean", 0.5)]
)
def test_per_call_rewards_reduce_by_the_configured_rule(rule: str, expected: float) -> None:
    assert reduce_rewards([0.5, 1.0, 0.0], rule) == expected  # type: ignore[arg-type]
    assert reduce_rewards([], rule) == 0.0  # type: ignore[arg-type]


def test_the_context_budget_caps_max_tokens() -> None:
    sampling = SamplingParams(max_tokens=64)
    assert sampling_within_budget(EpisodeConfig(sampling), 10_000) is sampling  # no budget
    config = EpisodeConfig(sampling, max_episode_tokens=500)
    assert sampling_within_budget(config, 400) is sampling  # 100 left >= 64
    assert sampling_within_budget(config, 470).max_tokens == 30
    assert (
        sampling_within_budget(config, 500) is None and sampling_within_budget(config, 600) is None
    )
    unlimited = EpisodeConfig(SamplingParams(), max_episode_tokens=500)
    assert sampling_within_budget(unlimited, 100).max_tokens == 400


def test_trajectory_counts_parse_errors_and_bridged_turns() -> None:
    completion = SampledSequence([5, 6], [-0.1, -0.2], "stop")
    trajectory = Trajectory(
        task={},
        turns=[
            Turn([1, 2], completion),
            Turn([1, 2, 5, 6, 7], completion, parse_ok=False, prompt_source="bridge"),
            Turn([1, 9], completion, prompt_source="render"),
        ],
    )
    assert trajectory.parse_errors == 1 and trajectory.bridged_turns == 1
