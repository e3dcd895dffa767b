"""PPO's critic in the `standard` batch preparer (plait_algorithms.critic), reached as a run
reaches it (the batch preparer with the run's critic): the estimator gets the critic's value of
every action token, the critic is fit once to advantage + value and the advantages are
whitened; on a critic whose values are known (the real value model is plait-torch's, tested there
and end to end)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from plait.api import (
    AdamParams,
    ConfigError,
    Critic,
    Datum,
    ForwardBackwardOutput,
    OptimStepResult,
    TensorData,
    TrainerCapabilities,
    load_config,
)
from plait.components import validate_components
from plait.config import CriticSection
from plait_algorithms.advantages import EPS
from plait_algorithms.batch import prepare
from plait_algorithms.critic import explained_variance
from plait_testing.trajectories import episode


class KnownValues:
    """A value model whose value at a position is a tenth of its target token; it records the
    data of each training call."""

    capabilities = TrainerCapabilities(value_head=True)

    def __init__(self) -> None:
        self.fitted: list[list[Datum]] = []
        self.steps = 0

    def forward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        assert loss_fn == "value"
        outputs = [
            {"values": TensorData.from_numpy(0.1 * d.loss_fn_inputs["target_tokens"].to_numpy())}
            for d in data
        ]
        return ForwardBackwardOutput(loss_fn, outputs, {"loss:sum": 0.0})

    def forward_backward(
        self, data: Sequence[Datum], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> ForwardBackwardOutput:
        self.fitted.append(list(data))
        return ForwardBackwardOutput(loss_fn, [{} for _ in data], {"loss:sum": 0.25})

    def optim_step(self, adam_params: AdamParams) -> OptimStepResult:
        self.steps += 1
        return OptimStepResult(self.steps, {"grad_norm": 1.5})


def action_tokens(trajectory) -> np.ndarray:
    return np.asarray([t for turn in trajectory.turns for t in turn.completion.tokens])


def test_gae_sees_the_critics_values_and_the_critic_is_fit_to_the_returns():
    groups = [
        [episode(1.0, [3, 2]), episode(0.0, [4], offset=1)],  # two turns, two datums: 5 tokens
        [episode(1.0, [2]), episode(1.0, [3], offset=2)],  # constant, kept with a critic
    ]
    config = load_config(
        None,
        ["rl.advantage=gae", "rl.remove_constant_reward_groups=false", "rl.micro_batch_size=2"],
    )
    values = KnownValues()
    critic = Critic(CriticSection(), None, values)
    datums, metrics = prepare(config, groups, critic=critic)

    trajectories = [t for group in groups for t in group]
    expected_values = [0.1 * action_tokens(t) for t in trajectories]
    # gamma = lam = 1: each token's advantage is the reward minus its value, then whitened
    expected_advantages = [t.reward - v for t, v in zip(trajectories, expected_values, strict=True)]
    tokens = sum(v.size for v in expected_values)
    got = np.concatenate(
        [
            d.loss_fn_inputs["advantages"].to_numpy()[d.loss_fn_inputs["mask"].to_numpy() > 0]
            for d in datums
        ]
    )
    raw = np.concatenate(expected_advantages)
    whitened = (raw - raw.mean()) / (raw.std() + EPS)  # over the batch's action tokens
    np.testing.assert_allclose(got, whitened / tokens, rtol=1e-5)

    # one training step, over micro-batches of rl.micro_batch_size datums
    assert values.steps == 1 and [len(call) for call in values.fitted] == [2, 2, 1]
    fitted = [datum for call in values.fitted for datum in call]
    returns = np.concatenate([r[m > 0] for r, m in _inputs(fitted, "returns", "mask")])
    old = np.concatenate([v[m > 0] for v, m in _inputs(fitted, "values", "mask")])
    rewards = np.concatenate(
        [np.full(v.size, t.reward) for t, v in zip(trajectories, expected_values, strict=True)]
    )
    np.testing.assert_allclose(returns, rewards, rtol=1e-6)  # advantage + value
    np.testing.assert_allclose(old, np.concatenate(expected_values), rtol=1e-6)
    for weights, mask in _inputs(fitted, "weights", "mask"):
        np.testing.assert_allclose(weights, mask / tokens, rtol=1e-6)

    flat_values = np.concatenate(expected_values)
    assert metrics["critic/explained_variance"] == pytest.approx(
        1 - np.var(rewards - flat_values) / np.var(rewards)
    )
    for where, position in (("first", 0), ("last", -1)):
        at = np.array([v[position] for v in expected_values])
        rewarded = np.array([t.reward for t in trajectories])
        assert metrics[f"critic/explained_variance_{where}_token"] == pytest.approx(
            1 - np.var(rewarded - at) / np.var(rewarded)
        )
    assert metrics["critic/value_loss"] == 3 * 0.25  # summed over the micro-batches
    assert metrics["critic/grad_norm"] == 1.5
    assert metrics["critic/values_mean"] == pytest.approx(flat_values.mean())
    assert metrics["critic/returns_mean"] == pytest.approx(rewards.mean())


def test_explained_variance():
    returns = np.asarray([0.0, 1.0, 1.0, 0.0])
    assert explained_variance(returns, returns) == 1.0
    assert explained_variance(returns, np.full(4, 0.5)) == 0.0  # the mean explains nothing
    assert explained_variance(returns, 1 - returns) < 0
    assert explained_variance(np.ones(4), np.zeros(4)) == 0.0  # returns that do not vary
    assert explained_variance(np.zeros(0), np.zeros(0)) == 0.0  # no returns


@pytest.mark.parametrize("rewards", [(1.0, 0.0), (1.0, 1.0)])
def test_explained_variance_is_0_where_every_sample_ends_alike(rewards):
    """With lam < 1 the returns mix in the critic's values, so they differ even where every
    reward is the same; the figures then say 0, not a large negative number."""
    groups = [[episode(r, [3, 2, 5], offset=i) for i, r in enumerate(rewards)]]
    config = load_config(
        None,
        [
            "rl.advantage=gae",
            "rl.advantage_options.lam=0.5",
            "rl.remove_constant_reward_groups=false",
        ],
    )
    _, metrics = prepare(config, groups, critic=Critic(CriticSection(), None, KnownValues()))
    figures = [v for k, v in metrics.items() if k.startswith("critic/explained_variance")]
    assert len(figures) == 3
    if rewards[0] == rewards[1]:
        assert figures == [0.0, 0.0, 0.0]
    else:
        assert all(f != 0.0 for f in figures)


def _inputs(data: Sequence[Datum], *keys: str) -> list[tuple[np.ndarray, ...]]:
    return [tuple(d.loss_fn_inputs[k].to_numpy() for k in keys) for d in data]


def test_several_updates_fit_the_critic_on_the_same_batch_again():
    groups = [[episode(1.0, [3]), episode(0.0, [2], offset=1)]]
    config = load_config(None, ["rl.advantage=gae"])
    values = KnownValues()
    prepare(config, groups, critic=Critic(CriticSection(updates=3), None, values))
    assert values.steps == 3 and len(values.fitted) == 3
    assert all(len(call) == 2 for call in values.fitted)  # the whole batch, every time


def test_a_critic_and_an_estimator_built_on_its_values_go_together_at_config_load():
    with pytest.raises(ConfigError, match=r"rl\.advantage: the run has a critic, and 'grpo'"):
        validate_components(load_config(None, ["rl.advantage=grpo", "critic.updates=1"]))
    with pytest.raises(ConfigError, match=r"rl\.advantage: gae needs a critic's values"):
        validate_components(load_config(None, ["rl.advantage=gae"]))


def test_a_critic_without_a_value_head_is_named():
    class Logprobs(KnownValues):
        capabilities = TrainerCapabilities()

    groups = [[episode(1.0, [3]), episode(0.0, [2], offset=1)]]
    critic = Critic(CriticSection(), None, Logprobs())
    with pytest.raises(ConfigError, match=r"critic\.trainer\.options: .* logprobs, not values"):
        prepare(load_config(None, ["rl.advantage=gae"]), groups, critic=critic)
