"""The losses against Tinker's documented formulas (token sums)."""

import pytest

torch = pytest.importorskip("torch")

from plait_train.losses import BUILTIN_LOSSES, check_inputs  # noqa: E402


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(2, 5, generator=g) * 3).requires_grad_()
    q = -torch.rand(2, 5, generator=g) * 3
    adv = torch.randn(2, 5, generator=g)
    return lp, {
        "target_tokens": torch.zeros(2, 5, dtype=torch.long),
        "logprobs": q,
        "advantages": adv,
        "weights": torch.rand(2, 5, generator=g),
    }


def test_cross_entropy(batch):
    lp, inputs = batch
    out = BUILTIN_LOSSES["cross_entropy"](lp, inputs, {})
    assert torch.allclose(out.loss, -(lp * inputs["weights"]).sum())
    assert out.metrics["loss:sum"] == pytest.approx(float(out.loss.detach()))


def test_importance_sampling(batch):
    lp, inputs = batch
    out = BUILTIN_LOSSES["importance_sampling"](lp, inputs, {})
    expected = -(torch.exp(lp - inputs["logprobs"]) * inputs["advantages"]).sum()
    assert torch.allclose(out.loss, expected)
    ratio = torch.exp(lp - inputs["logprobs"]).detach()
    assert out.metrics["importance_weight:max"] == pytest.approx(float(ratio.max()), rel=1e-5)


def test_ppo_default_and_custom_clip(batch):
    lp, inputs = batch
    r = torch.exp(lp - inputs["logprobs"])
    a = inputs["advantages"]
    for cfg, (lo, hi) in [
        ({}, (0.8, 1.2)),
        ({"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}, (0.5, 2.0)),
    ]:
        out = BUILTIN_LOSSES["ppo"](lp, inputs, cfg)
        expected = -torch.minimum(r * a, torch.clamp(r, lo, hi) * a).sum()
        assert torch.allclose(out.loss, expected)


def test_cispo_gradient_flows_through_logprobs_only(batch):
    lp, inputs = batch
    out = BUILTIN_LOSSES["cispo"](lp, inputs, {})
    r = torch.exp(lp - inputs["logprobs"]).detach()
    expected = -(torch.clamp(r, 0.0, 4.0) * lp * inputs["advantages"]).sum()
    assert torch.allclose(out.loss, expected)
    out.loss.backward()
    assert torch.allclose(lp.grad, -(torch.clamp(r, 0.0, 4.0) * inputs["advantages"]))


def test_dro_needs_beta(batch):
    lp, inputs = batch
    with pytest.raises(ValueError, match="beta"):
        BUILTIN_LOSSES["dro"](lp, inputs, {})
    out = BUILTIN_LOSSES["dro"](lp, inputs, {"beta": 0.1})
    q, a = inputs["logprobs"], inputs["advantages"]
    assert torch.allclose(out.loss, -(lp * a - 0.05 * (lp - q) ** 2).sum())


def test_unknown_config_key_is_an_error(batch):
    lp, inputs = batch
    with pytest.raises(ValueError, match="clip_low"):
        BUILTIN_LOSSES["ppo"](lp, inputs, {"clip_lo": 0.1})


def test_missing_inputs_are_named():
    with pytest.raises(ValueError, match=r"missing \['advantages'\]"):
        check_inputs("ppo", ["target_tokens", "logprobs"])


def test_padding_contributes_nothing():
    lp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    inputs = {
        "target_tokens": torch.zeros(1, 3, dtype=torch.long),
        "logprobs": torch.tensor([[-1.5, -1.0, 0.0]]),
        "advantages": torch.tensor([[1.0, -1.0, 0.0]]),
        "weights": torch.tensor([[1.0, 1.0, 0.0]]),
    }
    full = {
        name: fn(lp, inputs, {"beta": 0.1} if name == "dro" else {}).loss
        for name, fn in BUILTIN_LOSSES.items()
    }
    short_inputs = {k: v[:, :2] for k, v in inputs.items()}
    for name, fn in BUILTIN_LOSSES.items():
        short = fn(lp[:, :2], short_inputs, {"beta": 0.1} if name == "dro" else {}).loss
        assert torch.allclose(full[name], short), name
