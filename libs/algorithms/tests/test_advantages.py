"""The advantage estimators against their formulas, through the registry as a run looks them
up."""

import numpy as np

from plait.api import ADVANTAGE, get_registry


def group_advantages(rewards, name):
    return get_registry().get(ADVANTAGE, name).load()(np.asarray(rewards, dtype=np.float64))


def test_grpo_normalises_and_centres():
    adv = group_advantages([1, 0, 0, 1], "grpo")
    assert np.allclose(adv, [1, -1, -1, 1], atol=1e-5)


def test_dr_grpo_and_rloo():
    assert np.allclose(group_advantages([1, 0, 0, 0], "dr_grpo"), [0.75, -0.25, -0.25, -0.25])
    # leave-one-out: r_i - mean(others)
    r = [1.0, 0.0, 0.5]
    expected = [ri - np.mean([x for j, x in enumerate(r) if j != i]) for i, ri in enumerate(r)]
    assert np.allclose(group_advantages(r, "rloo"), expected)


def test_constant_groups_have_zero_advantage():
    for kind in ("grpo", "dr_grpo", "rloo"):
        assert np.allclose(group_advantages([0.5] * 4, kind), 0)
