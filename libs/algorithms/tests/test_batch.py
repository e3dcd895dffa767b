"""The `standard` batch preparer (plait_algorithms.batch, `rl.batch_preparer`): how token losses
are weighed (`rl.loss_aggregation`) and samples a length limit cut (`rl.overlong`,
`rl.overlong_buffer`), checked on fixed trajectories against computations written out by hand.
Dynamic sampling, which the run loop drives, and the config's errors are tested in
tests/test_batch_shaping.py."""

from __future__ import annotations

import numpy as np
import pytest

from plait.api import (
    ADVANTAGE,
    get_registry,
    load_config,
)
from plait.plugins import Factory, get_plugin_manager
from plait_algorithms.advantages import EPS
from plait_algorithms.batch import prepare
from plait_testing.trajectories import episode


@pytest.fixture
def registry():
    """The registry, for a test to add estimators to (gone after it)."""
    get_plugin_manager.cache_clear()
    yield get_registry()
    get_plugin_manager.cache_clear()


@pytest.fixture
def ones(registry):
    """An estimator that gives every action token the advantage 1 (so a datum's advantages are
    its tokens' weights); the batches it was given."""
    calls = []

    def ones(batch, *, options):
        calls.append(batch)
        return [[np.ones(n) for n in counts] for counts in batch.action_tokens]

    registry.add(Factory(ADVANTAGE, "ones", ones, plugin="test"))
    return calls


def per_sample(datums, counts):
    """The action-token advantages of each sample, from datums in sample order."""
    values = np.concatenate(
        [
            d.loss_fn_inputs["advantages"].to_numpy()[d.loss_fn_inputs["mask"].to_numpy() > 0]
            for d in datums
        ]
    )
    return np.split(values, np.cumsum(counts)[:-1])


# -- every switch off: today's datums --------------------------------------------------------


def todays_datums(groups):
    """What the batch preparer made before issue 30 (grpo, constant groups left out, every token
    1 / the batch's action tokens), written out: (model input ids, loss inputs) per datum."""
    from plait_algorithms.datums import trajectory_to_datums

    kept = []
    for group in groups:
        valid = [t for t in group if t.error is None]
        rewards = np.asarray([t.reward for t in valid], dtype=np.float64)
        if rewards.size and np.ptp(rewards) > 0:
            kept.append((valid, (rewards - rewards.mean()) / (rewards.std() + EPS)))
    tokens = sum(t.completion_tokens for valid, _ in kept for t in valid)
    out = []
    for valid, advantages in kept:
        for t, a in zip(valid, advantages, strict=True):
            for d in trajectory_to_datums(t, 0.0):
                mask = d.loss_fn_inputs["mask"].to_numpy()
                placed = np.where(mask > 0, np.float32(a), np.float32(0)) * (1.0 / tokens)
                out.append((d.model_input.to_ints(), {**d.loss_fn_inputs, "advantages": placed}))
    return out


def test_with_every_new_switch_off_the_preparer_gives_todays_datums():
    groups = [
        [episode(1.0, [3, 2]), episode(0.0, [4], stop="length", offset=1)],
        [episode(1.0, [2]), episode(1.0, [5], offset=2)],  # constant: left out
        [
            episode(0.0, [1, 2, 3], offset=3),
            episode(0.5, [2], error="env died"),
            episode(0.5, [3], stop="length"),
        ],
    ]
    config = load_config(None, ["rl.advantage=grpo"])
    assert (config.rl.loss_aggregation, config.rl.overlong, config.rl.dynamic_sampling) == (
        "token_mean",
        "keep",
        False,
    )
    datums, metrics = prepare(config, groups)
    expected = todays_datums(groups)
    assert len(datums) == len(expected) == 6
    for datum, (ids, inputs) in zip(datums, expected, strict=True):
        assert datum.model_input.to_ints() == ids
        assert datum.loss_fn_inputs.keys() == inputs.keys()
        for key, value in inputs.items():
            got = datum.loss_fn_inputs[key].to_numpy()
            want = value.to_numpy() if hasattr(value, "to_numpy") else value
            assert got.dtype == want.dtype and np.array_equal(got, want), key
    assert metrics["data/action_tokens"] == 5 + 4 + 6 + 3
    assert metrics["data/overlong"] == pytest.approx(2 / 6)
    assert "data/overlong_masked" not in metrics


# -- loss aggregation ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["token_mean", "sequence_mean", "sequence_sum"])
def test_loss_aggregation_weighs_each_token_as_written(ones, how):
    groups = [
        [episode(1.0, [3, 2]), episode(0.0, [1])],  # 5 and 1 action tokens
        [episode(0.0, [4]), episode(1.0, [2, 2, 2], offset=1)],  # 4 and 6
    ]
    counts = [5, 1, 4, 6]
    datums, _ = prepare(
        load_config(None, ["rl.advantage=ones", f"rl.loss_aggregation={how}"]), groups
    )
    weights = {
        "token_mean": [1 / 16] * 4,  # 1 / the batch's action tokens
        "sequence_mean": [1 / (5 * 4), 1 / (1 * 4), 1 / (4 * 4), 1 / (6 * 4)],
        "sequence_sum": [1 / 4] * 4,  # 1 / the batch's samples
    }[how]
    for got, n, w in zip(per_sample(datums, counts), counts, weights, strict=True):
        assert np.allclose(got, np.full(n, w, np.float32)), (how, n)
    if how == "sequence_mean":  # every sample weighs the same in all: 1 / samples
        assert [float(a.sum()) for a in per_sample(datums, counts)] == pytest.approx([0.25] * 4)


# -- overlong samples ------------------------------------------------------------------------


def test_mask_trains_on_no_cut_sample_but_keeps_it_in_the_baseline(ones):
    groups = [
        [episode(1.0, [4]), episode(0.0, [3], stop="length"), episode(0.0, [2], offset=1)],
        [episode(1.0, [2, 3], stop="length"), episode(0.0, [5], offset=2)],
        [episode(1.0, [2]), episode(1.0, [3])],  # constant: left out, not masked
    ]
    config = load_config(None, ["rl.advantage=ones", "rl.overlong=mask"])
    datums, metrics = prepare(config, groups)
    (batch,) = ones
    # the estimator sees every sample, the cut ones included (TRL computes advantages before
    # it masks), so they count in their group's baseline
    assert [r.tolist() for r in batch.rewards] == [[1.0, 0.0, 0.0], [1.0, 0.0]]
    assert [c.tolist() for c in batch.action_tokens] == [[4, 3, 2], [5, 5]]
    # only the samples that were not cut train, weighed over their own tokens: 4 + 2 + 5
    assert all(np.allclose(a, 1 / 11) for a in per_sample(datums, [4, 2, 5]))
    assert len(datums) == 3 and metrics["data/action_tokens"] == 11
    assert metrics["data/overlong"] == pytest.approx(2 / 7)
    assert metrics["data/overlong_masked"] == pytest.approx(2 / 7)


def test_penalty_is_dapos_soft_overlong_punishment(ones):
    # max_tokens 10, buffer 4: no penalty up to 6 tokens, then (6 - n) / 4, -1 when cut
    group = [
        episode(1.0, [6]),
        episode(1.0, [7]),
        episode(1.0, [9]),
        episode(1.0, [10]),  # stopped by itself at the limit: -1 by the formula
        episode(1.0, [5], stop="length"),  # cut (by the episode's budget): -1
        episode(1.0, [2, 8, 3], offset=1),  # its longest response counts: -0.5
    ]
    overrides = ["rl.advantage=ones", "rl.overlong=penalty", "rl.overlong_buffer=4"]
    config = load_config(None, [*overrides, "rl.max_tokens=10"])
    _, metrics = prepare(config, [group])
    (batch,) = ones
    assert batch.rewards[0].tolist() == pytest.approx([1.0, 0.75, 0.25, 0.0, 0.0, 0.5])
    assert metrics["data/overlong_penalised"] == pytest.approx(5 / 6)
    assert metrics["data/overlong"] == pytest.approx(1 / 6)
    # equal rewards, unequal lengths: the penalty gives the group a signal of its own
    assert metrics["data/groups_kept"] == 1


def test_a_group_equal_after_its_penalties_is_constant(ones):
    overrides = ["rl.advantage=ones", "rl.overlong=penalty", "rl.overlong_buffer=4"]
    config = load_config(None, [*overrides, "rl.max_tokens=10"])
    group = [episode(1.0, [3]), episode(0.0, [10], stop="length"), episode(0.0, [5], offset=1)]
    # rewards 1 - 0, 0 - 1, 0 - 0 differ; 1.0 with 6 tokens and 1.0 with 2 do not
    assert prepare(config, [group])[1]["data/groups_kept"] == 1
    same = [episode(1.0, [6]), episode(1.0, [2], offset=1)]
    assert prepare(config, [same])[1]["data/groups_constant"] == 1
