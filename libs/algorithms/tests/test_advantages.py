"""The advantage estimators against references written by hand in plain Python, each built
through the registry as a run builds it (`rl.advantage`, `rl.advantage_options`); and the run's
side: one call for the whole batch, each sample's advantages on its own action tokens."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from plait.api import (
    ADVANTAGE,
    AdvantageBatch,
    ConfigError,
    DataError,
    Trajectory,
    build,
    get_registry,
    load_config,
)
from plait.components import validate_components
from plait.plugins import Factory, get_plugin_manager
from plait_algorithms.advantages import EPS
from plait_algorithms.batch import prepare
from plait_testing.trajectories import turn

# Three groups (prompts) of samples: (reward, action tokens) each.
GROUPS = [[(1.0, 3), (0.0, 1), (0.0, 4), (1.0, 2)], [(0.5, 2), (0.25, 5), (1.0, 1)], [(2.0, 6)]]


def batch_of(groups, values=None) -> AdvantageBatch:
    return AdvantageBatch(
        [np.asarray([r for r, _ in g], dtype=np.float64) for g in groups],
        [np.asarray([n for _, n in g]) for g in groups],
        values,
    )


def estimate(name, groups=GROUPS, values=None, **options):
    return build(
        ADVANTAGE,
        name,
        batch_of(groups, values),
        options=options,
        options_path="rl.advantage_options",
    )


def assert_per_sample(result, expected):
    """`result` gives every action token of sample j of group g the advantage expected[g][j]."""
    assert len(result) == len(GROUPS)
    for got, want, group in zip(result, expected, GROUPS, strict=True):
        assert len(got) == len(group)
        for tokens, advantage, (_, n) in zip(got, want, group, strict=True):
            assert tokens.shape == (n,)
            assert np.allclose(tokens, advantage, atol=1e-9), (tokens, advantage)


def mean(xs):
    return sum(xs) / len(xs)


def std(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def test_grpo_dr_grpo_and_rloo_are_group_relative():
    rewards = [[r for r, _ in g] for g in GROUPS]
    assert_per_sample(
        estimate("grpo"), [[(r - mean(g)) / (std(g) + EPS) for r in g] for g in rewards]
    )
    assert_per_sample(estimate("dr_grpo"), [[r - mean(g) for r in g] for g in rewards])
    loo = [
        [r - mean(g[:i] + g[i + 1 :]) if len(g) > 1 else 0.0 for i, r in enumerate(g)]
        for g in rewards
    ]
    assert_per_sample(estimate("rloo"), loo)
    # the values the scalar estimators always gave
    (grpo,) = estimate("grpo", [[(1, 1), (0, 1), (0, 1), (1, 1)]])
    assert np.allclose(np.concatenate(grpo), [1, -1, -1, 1], atol=1e-5)


def test_reinforce_pp_normalises_over_every_token_of_the_batch():
    tokens = [r for g in GROUPS for r, n in g for _ in range(n)]  # each token's return
    expected = [[(r - mean(tokens)) / (std(tokens) + EPS) for r, _ in g] for g in GROUPS]
    assert_per_sample(estimate("reinforce++"), expected)


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_normalises_over_the_batch():
    centred = [[r - mean([x for x, _ in g]) for r, _ in g] for g in GROUPS]
    tokens = [
        c
        for g, cs in zip(GROUPS, centred, strict=True)
        for (_, n), c in zip(g, cs, strict=True)
        for _ in range(n)
    ]
    expected = [[(c - mean(tokens)) / (std(tokens) + EPS) for c in cs] for cs in centred]
    assert_per_sample(estimate("reinforce++_baseline"), expected)


def test_constant_groups_get_zeros_from_the_group_relative_estimators():
    for name in ("grpo", "dr_grpo", "rloo", "reinforce++_baseline"):
        (group,) = estimate(name, [[(0.5, 2)] * 4])
        assert all(np.allclose(a, 0) for a in group), name


def textbook_gae(reward, values, gamma, lam):
    """The backwards recursion: delta_t = r_t + gamma V(t+1) - V(t), A_t = delta_t + gamma lam
    A_t+1; the reward at the last token, V = 0 after it."""
    advantages, next_value, running = [0.0] * len(values), 0.0, 0.0
    for t in range(len(values) - 1, -1, -1):
        r = reward if t == len(values) - 1 else 0.0
        running = r + gamma * next_value - values[t] + gamma * lam * running
        advantages[t] = running
        next_value = values[t]
    return advantages


def critic_values(groups, seed=0):
    rng = random.Random(seed)
    return [[np.asarray([rng.uniform(-1, 1) for _ in range(n)]) for _, n in g] for g in groups]


def samples_of(result, values):
    """(advantages, reward, action tokens, values) of every sample, group after group."""
    for got_group, group, value_group in zip(result, GROUPS, values, strict=True):
        for got, (reward, n), v in zip(got_group, group, value_group, strict=True):
            yield got, reward, n, list(v)


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0), (1.0, 0.3)])
def test_gae_is_the_textbook_recursion(gamma, lam):
    values = critic_values(GROUPS)
    result = estimate("gae", values=values, gamma=gamma, lam=lam)
    for got, reward, _, v in samples_of(result, values):
        assert np.allclose(got, textbook_gae(reward, v, gamma, lam))


def test_gae_at_its_limits():
    values = critic_values(GROUPS, seed=1)
    # lam = 1: the discounted return minus the value (r - V by default: gamma = 1)
    for options in ({}, {"gamma": 0.8}):
        gamma = options.get("gamma", 1.0)
        for got, reward, n, v in samples_of(estimate("gae", values=values, **options), values):
            assert np.allclose(got, [gamma ** (n - 1 - t) * reward - v[t] for t in range(n)])
    # lam = 0: the one-step TD error
    for got, reward, n, v in samples_of(estimate("gae", values=values, gamma=0.9, lam=0), values):
        after = [*v[1:], 0.0]
        expected = [(reward if t == n - 1 else 0.0) + 0.9 * after[t] - v[t] for t in range(n)]
        assert np.allclose(got, expected)


def test_gae_without_a_critic_says_it_needs_one():
    with pytest.raises(ConfigError, match=r"rl\.advantage: gae needs a critic's values") as info:
        estimate("gae")
    assert "grpo" in (info.value.fix or "")


def test_options_are_checked_naming_the_key():
    with pytest.raises(
        ConfigError, match=r'rl\.advantage_options\.gama: unknown key \(did you mean "gamma"'
    ):
        estimate("gae", values=critic_values(GROUPS), gama=0.9)
    with pytest.raises(ConfigError, match=r"rl\.advantage_options: lam must be in \[0, 1\]"):
        estimate("gae", values=critic_values(GROUPS), lam=1.5)
    with pytest.raises(ConfigError, match=r"rl\.advantage_options\.gamma: this component takes no"):
        estimate("grpo", gamma=0.9)


def test_a_run_config_checks_the_options_when_it_loads():
    config = load_config(None, ["rl.advantage=gae", "rl.advantage_options.gama=0.9"])
    with pytest.raises(ConfigError, match=r"rl\.advantage_options\.gama: unknown key \(did you"):
        validate_components(config)


# -- The run's side: prepare_groups ---------------------------------------------------------


def trajectory(reward, offset):
    """Three turns, the last re-rendered (so a second datum): 2 + 1 action tokens, then 2."""
    first = turn([1, 2], [10 + offset, 11])
    second = turn([1, 2, 10 + offset, 11, 9], [12])
    third = turn([1, 3], [13, 14])
    return Trajectory(task={}, turns=[first, second, third], reward=reward)


@pytest.fixture
def registry():
    """The registry, for a test to add estimators to (gone after it: the registry is
    process-wide)."""
    get_plugin_manager.cache_clear()
    yield get_registry()
    get_plugin_manager.cache_clear()


@pytest.fixture
def ramp(registry):
    """An estimator registered for one test: sample j of group g gets 100 g + 10 j + t on its
    action token t, so every token's place shows where it landed; the batches it was given."""
    calls = []

    def ramp(batch, *, options):
        calls.append(batch)
        return [
            [100.0 * g + 10.0 * j + np.arange(n) for j, n in enumerate(counts)]
            for g, counts in enumerate(batch.action_tokens)
        ]

    registry.add(Factory(ADVANTAGE, "ramp", ramp, plugin="test"))
    return calls


def action_advantages(datums):
    return np.concatenate(
        [
            d.loss_fn_inputs["advantages"].to_numpy()[d.loss_fn_inputs["mask"].to_numpy() > 0]
            for d in datums
        ]
    )


def test_the_run_calls_the_estimator_once_and_maps_each_token_onto_its_datum(ramp):
    config = load_config(None, ["rl.advantage=ramp"])
    groups = [
        [trajectory(1.0, 0), trajectory(0.0, 1)],
        [trajectory(1.0, 2), trajectory(1.0, 3)],  # constant: left out
        [trajectory(0.0, 4), trajectory(0.5, 5)],
    ]
    datums, metrics = prepare(config, groups)
    (batch,) = ramp
    assert [r.tolist() for r in batch.rewards] == [[1.0, 0.0], [0.0, 0.5]]
    assert [c.tolist() for c in batch.action_tokens] == [[5, 5], [5, 5]]
    assert batch.values is None
    assert len(datums) == 8  # two per trajectory
    assert metrics["data/action_tokens"] == 20
    assert metrics["data/groups_constant"] == 1
    for index, (g, j) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        sample = datums[2 * index : 2 * index + 2]
        expected = (100.0 * g + 10.0 * j + np.arange(5)) / 20  # token-level mean scaling
        assert np.allclose(action_advantages(sample), expected)
        for d in sample:  # nothing off the action tokens
            inputs = d.loss_fn_inputs
            assert not inputs["advantages"].to_numpy()[inputs["mask"].to_numpy() == 0].any()


def test_grpo_datums_are_as_before_one_advantage_per_sample_scaled_by_the_batch_tokens():
    config = load_config(None, ["rl.advantage=grpo"])
    groups = [[trajectory(1.0, 0), trajectory(0.0, 1), trajectory(0.0, 2)]]
    datums, _ = prepare(config, groups)
    rewards = np.asarray([1.0, 0.0, 0.0])
    advantages = (rewards - rewards.mean()) / (rewards.std() + EPS)
    for index, advantage in enumerate(advantages):
        got = action_advantages(datums[2 * index : 2 * index + 2])
        assert np.array_equal(got, np.full(5, np.float32(advantage)) * (1.0 / 15))


def test_an_estimator_that_miscounts_tokens_is_named(registry):
    def short(batch, *, options):
        return [[np.zeros(n - 1) for n in counts] for counts in batch.action_tokens]

    registry.add(Factory(ADVANTAGE, "short", short, plugin="test"))
    config = load_config(None, ["rl.advantage=short"])
    with pytest.raises(DataError, match=r"\(rl\.advantage\) gave 4 advantages to a sample of 5"):
        prepare(config, [[trajectory(1.0, 0), trajectory(0.0, 1)]])
