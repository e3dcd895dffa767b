"""Off-policy correction: truncated importance weights per token and per sequence, masking of
extreme ratios, the loss's ratio re-based on the trainer, and the metrics it reports."""

from __future__ import annotations

import math

import numpy as np
import pytest

from plait.config import OffPolicySection
from plait.errors import ConfigError
from plait.schema import structure
from plait_algorithms import off_policy
from plait_testing.trainer import rl_datum

# prompt of 3 tokens, completion of 4: positions 2..5 of the shifted datum are sampled
ROLLOUT = [-1.0, -2.0, -0.5, -3.0]
PROMPT_PAD = [0.0, 0.0]


def datum(advantage: float = 1.0):
    return rl_datum([5, 6, 7, 8, 9, 10, 11], 3, ROLLOUT, advantage)


def train_lp(deltas: list[float]) -> np.ndarray:
    """Trainer logprobs that differ from the sampler's by `deltas` (log w per sampled token)."""
    return np.asarray(PROMPT_PAD + [r + d for r, d in zip(ROLLOUT, deltas, strict=True)])


def importance_correction(datums, train_logprobs, options: OffPolicySection):
    """The registered correction that `options.correction` names."""
    return getattr(off_policy, options.correction)(datums, train_logprobs, options)


def field(d, key: str) -> np.ndarray:
    return d.loss_fn_inputs[key].to_numpy()


def test_token_level_truncates_weights_and_rebases_the_ratio():
    deltas = [0.0, math.log(3.0), math.log(0.5), math.log(1.5)]
    (out,), metrics = importance_correction(
        [datum(2.0)], [train_lp(deltas)], OffPolicySection(correction="token", truncate=2.0)
    )
    np.testing.assert_allclose(field(out, "advantages")[2:], [2.0, 4.0, 1.0, 3.0])  # 2 * min(w, 2)
    np.testing.assert_allclose(field(out, "advantages")[:2], 0.0)
    np.testing.assert_allclose(
        field(out, "logprobs")[2:], train_lp(deltas)[2:]
    )  # ratio against pi_train
    np.testing.assert_array_equal(field(out, "mask"), [0, 0, 1, 1, 1, 1])
    assert metrics["policy/importance_weight_max"] == pytest.approx(3.0)
    assert metrics["policy/importance_weight_mean"] == pytest.approx((1 + 3 + 0.5 + 1.5) / 4)
    assert metrics["policy/is_truncated_fraction"] == pytest.approx(0.25)
    assert metrics["policy/is_weight_applied_max"] == pytest.approx(2.0)
    assert metrics["policy/mismatch_kl"] == pytest.approx(-np.mean(deltas))
    assert metrics["policy/is_masked_fraction"] == 0.0


def test_token_level_masks_extreme_ratios_in_both_directions():
    deltas = [0.0, math.log(10.0), math.log(0.01), 0.0]
    (out,), metrics = importance_correction(
        [datum()],
        [train_lp(deltas)],
        OffPolicySection(correction="token", truncate=2.0, mask_below=0.1, mask_above=5.0),
    )
    np.testing.assert_array_equal(field(out, "mask"), [0, 0, 1, 0, 0, 1])
    np.testing.assert_allclose(field(out, "advantages")[2:], [1.0, 0.0, 0.0, 1.0])
    assert metrics["policy/is_masked_fraction"] == pytest.approx(0.5)


def test_sequence_level_uses_one_weight_per_sequence():
    deltas = [math.log(2.0), math.log(2.0), 0.0, math.log(0.5)]  # product 2
    near, far = importance_correction(
        [datum(), datum()],
        [train_lp(deltas), train_lp([math.log(3.0)] * 4)],  # product 81
        OffPolicySection(correction="sequence", truncate=1.5, mask_above=50.0),
    )[0]
    np.testing.assert_allclose(field(near, "advantages")[2:], [1.5] * 4)
    np.testing.assert_array_equal(field(far, "mask")[2:], [0, 0, 0, 0])


def test_no_signal_tokens_give_no_metrics():
    out, metrics = importance_correction([], [], OffPolicySection(correction="token"))
    assert out == [] and metrics == {}


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"truncate": 0.5}, "truncate"),
        ({"mask_below": 1.5}, "mask_below"),
        ({"truncate": 4.0, "mask_above": 3.0}, "mask_above"),
        ({"max_staleness": -1}, "max_staleness"),
    ],
)
def test_bad_options_name_their_key(options, key):
    with pytest.raises(ConfigError, match=f"off_policy.*{key}"):
        structure(OffPolicySection, options, "off_policy")
