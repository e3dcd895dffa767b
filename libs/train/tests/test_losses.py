"""The losses against hand-written references of their formulas (token sums), values and
gradients with respect to the trainer's logprobs."""

import math

import pytest

torch = pytest.importorskip("torch")

from plait_train.losses import BUILTIN_LOSSES, KL_ESTIMATORS, check_inputs  # noqa: E402

CONFIGS = {"dro": {"beta": 0.1}}


@pytest.fixture
def batch():
    """Two padded datums, 8 and 5 positions with a prompt position first; ratios r = exp(lp - q)
    in every regime of the clipped losses (inside PPO's range, above and below it with either
    sign of advantage, between PPO's 1.2 and DAPO's 1.28, above the dual clip's c)."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0.0, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0, 0]])
    ratio = torch.tensor(
        [[1.0, 1.05, 1.25, 1.6, 0.6, 0.9, 4.0, 1.1], [1.0, 0.7, 2.5, 1.24, 5.0, 1.0, 1.0, 1.0]]
    )
    adv = torch.tensor(
        [[0.0, 0.7, 1.2, -0.5, -1.3, 0.4, -0.8, 0.3], [0.0, 0.9, -1.1, 0.6, -0.4, 0.0, 0.0, 0.0]]
    )
    q = -torch.rand(2, 8, generator=g) * 3 * mask
    lp = ((q + ratio.log()) * mask).requires_grad_()
    return lp, {
        "target_tokens": torch.zeros(2, 8, dtype=torch.long),
        "logprobs": q,
        "advantages": adv,
        "weights": torch.rand(2, 8, generator=g) * mask,
        "mask": mask,
    }


def loss_and_grad(name, lp, inputs, config=None):
    out = BUILTIN_LOSSES[name](lp, inputs, CONFIGS.get(name, {}) if config is None else config)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out, grad


def assert_reference(out, grad, loss, expected_grad):
    torch.testing.assert_close(out.loss.detach(), loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(float(loss), rel=1e-6, abs=1e-6)


def test_cross_entropy(batch):
    lp, inputs = batch
    w = inputs["weights"]
    assert_reference(*loss_and_grad("cross_entropy", lp, inputs), -(lp.detach() * w).sum(), -w)


def test_importance_sampling(batch):
    lp, inputs = batch
    r = torch.exp(lp.detach() - inputs["logprobs"])
    a = inputs["advantages"]
    out, grad = loss_and_grad("importance_sampling", lp, inputs)
    assert_reference(out, grad, -(r * a).sum(), -r * a)
    assert out.metrics["importance_weight:max"] == pytest.approx(5.0, rel=1e-5)


def ppo_reference(lp, q, a, low, high):
    """-sum min(r A, clip(r) A) and its gradient: -r A where the unclipped term is the minimum
    (d r / d lp = r), 0 where the clipped one is (a constant)."""
    r = torch.exp(lp - q)
    unclipped, clipped = r * a, torch.clamp(r, low, high) * a
    return -torch.minimum(unclipped, clipped).sum(), torch.where(clipped < unclipped, 0.0, -r * a)


@pytest.mark.parametrize(
    "config, low, high",
    [
        ({}, 0.8, 1.2),
        ({"clip_low_threshold": 0.65, "clip_high_threshold": 1.5}, 0.65, 1.5),
        # DAPO's asymmetric clip-higher (Yu et al. 2025)
        ({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}, 0.8, 1.28),
    ],
    ids=["default", "custom", "dapo"],
)
def test_ppo(batch, config, low, high):
    lp, inputs = batch
    q, a = inputs["logprobs"], inputs["advantages"]
    out, grad = loss_and_grad("ppo", lp, inputs, config)
    assert_reference(out, grad, *ppo_reference(lp.detach(), q, a, low, high))
    r = torch.exp(lp.detach() - q)
    binds = (torch.clamp(r, low, high) * a < r * a) & (a != 0)
    assert 0 < out.metrics["clip_fraction:mean"] < 1, "the batch exercises both cases"
    assert out.metrics["clip_fraction:mean"] == pytest.approx(float(binds.sum()) / 11)


def test_dapo_clips_higher_on_positive_advantages():
    """A positive-advantage token at r = 1.25 is clipped by PPO's 1.2 but not by DAPO's 1.28:
    its gradient survives; at r = 1.3 both clip it."""
    q = torch.zeros(3)
    lp = torch.log(torch.tensor([1.25, 1.3, 0.75])).requires_grad_()
    inputs = {"target_tokens": torch.zeros(3, dtype=torch.long), "logprobs": q}
    inputs["advantages"] = torch.tensor([1.0, 2.0, -1.0])
    dapo = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}
    out, grad = loss_and_grad("ppo", lp, inputs, dapo)
    # 1.25 * 1 + 1.28 * 2 + clip(0.75) = 0.8 * -1 (A < 0: the clipped term is the minimum)
    assert float(out.loss.detach()) == pytest.approx(-(1.25 + 2.56 - 0.8))
    torch.testing.assert_close(grad, torch.tensor([-1.25, 0.0, 0.0]))
    _, ppo_grad = loss_and_grad("ppo", lp, inputs, {})
    torch.testing.assert_close(ppo_grad, torch.zeros(3))


def test_cispo_gradient_flows_through_logprobs_only(batch):
    lp, inputs = batch
    r = torch.exp(lp.detach() - inputs["logprobs"])
    a = inputs["advantages"]
    clipped = torch.clamp(r, 0.0, 4.0)
    out, grad = loss_and_grad("cispo", lp, inputs)
    assert_reference(out, grad, -(clipped * lp.detach() * a).sum(), -clipped * a)
    out, grad = loss_and_grad(
        "cispo", lp, inputs, {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}
    )
    clipped = torch.clamp(r, 0.5, 1.5)
    assert_reference(out, grad, -(clipped * lp.detach() * a).sum(), -clipped * a)


def test_dro(batch):
    lp, inputs = batch
    with pytest.raises(ValueError, match="beta"):
        BUILTIN_LOSSES["dro"](lp, inputs, {})
    q, a = inputs["logprobs"], inputs["advantages"]
    x = lp.detach()
    out, grad = loss_and_grad("dro", lp, inputs, {"beta": 0.1})
    assert_reference(out, grad, -(x * a - 0.05 * (x - q) ** 2).sum(), -(a - 0.1 * (x - q)))


def test_ppo_dual_clip(batch):
    """verl's clip_ratio_c: on A < 0, max(min(r A, clip(r) A), c A); the floor's tokens take no
    gradient."""
    lp, inputs = batch
    q, a = inputs["logprobs"], inputs["advantages"]
    x = lp.detach()
    for config, (low, high, c) in [
        ({}, (0.8, 1.2, 3.0)),
        (
            {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3, "dual_clip": 1.5},
            (0.7, 1.3, 1.5),
        ),
    ]:
        out, grad = loss_and_grad("ppo_dual_clip", lp, inputs, config)
        _, ppo_grad = ppo_reference(x, q, a, low, high)
        r = torch.exp(x - q)
        objective = torch.minimum(r * a, torch.clamp(r, low, high) * a)
        floored = (a < 0) & (c * a > objective)
        assert floored.any() and (~floored & (a < 0)).any(), "the batch exercises both cases"
        expected = -torch.where(floored, c * a, objective).sum()
        assert_reference(out, grad, expected, torch.where(floored, 0.0, ppo_grad))
        assert out.metrics["dual_clip_fraction:mean"] == pytest.approx(float(floored.sum()) / 11)


def test_ppo_dual_clip_needs_c_above_one(batch):
    lp, inputs = batch
    with pytest.raises(ValueError, match=r"loss_fn_config\['dual_clip'\] > 1"):
        BUILTIN_LOSSES["ppo_dual_clip"](lp, inputs, {"dual_clip": 1.0})


def gspo_reference(lp, q, a, mask, low, high):
    """Row by row: s = exp(mean over the sampled tokens of lp - q); the loss -sum_t min(s A_t,
    clip(s, 1 - low, 1 + high) A_t); its gradient -s A_t (d s_t / d lp_t = s) unless the clipped
    term is the minimum."""
    loss, grad = torch.zeros(()), torch.zeros_like(lp)
    for i in range(lp.shape[0]):
        sampled = mask[i] > 0
        s = torch.exp((lp[i][sampled] - q[i][sampled]).mean())
        clipped = torch.clamp(s, 1 - low, 1 + high)
        for t in range(lp.shape[1]):
            loss -= torch.minimum(s * a[i, t], clipped * a[i, t])
            grad[i, t] = 0.0 if clipped * a[i, t] < s * a[i, t] else -s * a[i, t]
    return loss, grad


@pytest.mark.parametrize(
    "config, low, high",
    [({}, 3e-4, 4e-4), ({"clip_low": 0.2, "clip_high": 0.3}, 0.2, 0.3)],
    ids=["paper", "wide"],
)
def test_gspo(config, low, high):
    """Sequence ratios near 1 (as on policy), some inside the clip range and some out."""
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[0.0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0]] * 2)
    q = -torch.rand(6, 6, generator=g) * 2 * mask
    shift = torch.tensor([1e-4, -2e-4, 5e-4, -0.1, 0.25, 0.35])[:, None]
    lp = ((q + shift + 1e-4 * torch.randn(6, 6, generator=g)) * mask).requires_grad_()
    a = torch.randn(6, 6, generator=g) * mask  # per-token advantages
    inputs = {"target_tokens": torch.zeros(6, 6, dtype=torch.long), "logprobs": q}
    inputs |= {"advantages": a, "mask": mask}
    out, grad = loss_and_grad("gspo", lp, inputs, config)
    assert_reference(out, grad, *gspo_reference(lp.detach(), q, a, mask, low, high))
    assert 0 < out.metrics["clip_fraction:mean"] < 1


def test_gspo_takes_a_datum_alone_or_padded_in_a_batch(batch):
    """Each row is a sequence: a datum's (N,) loss and gradient are its row's, and padding
    changes neither; without a mask the sampled tokens are those with an advantage."""
    lp, inputs = batch
    config = {"clip_low": 0.5, "clip_high": 0.5}
    out, grad = loss_and_grad("gspo", lp, inputs, config)
    no_mask = {k: v for k, v in inputs.items() if k != "mask"}
    out_no_mask, grad_no_mask = loss_and_grad("gspo", lp, no_mask, config)
    torch.testing.assert_close(out_no_mask.loss, out.loss)
    torch.testing.assert_close(grad_no_mask, grad)
    total = torch.zeros(())
    for row, length in enumerate((8, 5)):
        alone = lp.detach()[row, :length].clone().requires_grad_()
        out_alone, grad_alone = loss_and_grad(
            "gspo", alone, {k: v[row, :length] for k, v in inputs.items()}, config
        )
        torch.testing.assert_close(grad_alone, grad[row, :length])
        total += out_alone.loss.detach()
    torch.testing.assert_close(total, out.loss.detach())


def value_reference(v, returns, old, w, clip):
    """Token by token: 0.5 w max((v - R)^2, (V_old + clip(v - V_old, -c, c) - R)^2); the
    gradient w (v - R) where the unclipped error is the larger, else w (v_c - R) where v moved
    less than c from V_old, else 0 (the clipped value does not move with v)."""
    loss, grad, clipped_tokens = torch.zeros(()), torch.zeros_like(v), 0
    for i in range(v.shape[0]):
        for t in range(v.shape[1]):
            error = (v[i, t] - returns[i, t]) ** 2
            moved = min(max(v[i, t] - old[i, t], -clip), clip)
            clipped_error = (old[i, t] + moved - returns[i, t]) ** 2
            if clip and clipped_error > error:
                loss += 0.5 * w[i, t] * clipped_error
                inside = abs(v[i, t] - old[i, t]) < clip
                grad[i, t] = w[i, t] * (old[i, t] + moved - returns[i, t]) if inside else 0.0
                clipped_tokens += bool(w[i, t] != 0)
            else:
                loss += 0.5 * w[i, t] * error
                grad[i, t] = w[i, t] * (v[i, t] - returns[i, t])
    return loss, grad, clipped_tokens


@pytest.mark.parametrize("clip", [0.5, 0.2, 0.0])
def test_value(batch, clip):
    """The critic's clipped value loss, on values that moved inside and beyond the clip from
    their old ones, towards and away from their returns."""
    _, inputs = batch
    w = inputs["weights"]
    old = torch.tensor(
        [[0.0, 0.1, 0.5, -0.2, 0.9, 0.3, 0.0, 0.4], [0.0, 0.2, 0.2, 0.6, -0.5, 0, 0, 0]]
    )
    v = (
        old
        + torch.tensor(
            [[0.0, 0.1, 0.8, -0.6, 0.3, -0.05, 0.0, 0.75], [0, -0.9, 0.25, 0.1, 0.6, 0, 0, 0]]
        )
    ).requires_grad_()
    returns = torch.tensor(
        [[0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0, 1.0, 0, 0, 0]]
    )
    value_inputs = {**inputs, "returns": returns, "values": old}
    out, grad = loss_and_grad("value", v, value_inputs, {"value_clip": clip})
    loss, expected_grad, clipped = value_reference(v.detach(), returns, old, w, clip)
    if clip == 0.2:
        assert 0 < clipped < int((w != 0).sum()), "the batch exercises both cases"
    assert_reference(out, grad, loss, expected_grad)
    if clip:
        assert out.metrics["value_clip_fraction:mean"] == pytest.approx(
            clipped / int((w != 0).sum())
        )


def test_unknown_config_key_is_an_error(batch):
    lp, inputs = batch
    with pytest.raises(ValueError, match="clip_low"):
        BUILTIN_LOSSES["ppo"](lp, inputs, {"clip_lo": 0.1})
    with pytest.raises(ValueError, match=r"it takes \['clip_high', 'clip_low'\]"):
        BUILTIN_LOSSES["gspo"](lp, inputs, {"clip_low_threshold": 0.1})


def test_missing_inputs_are_named():
    for name in ("ppo", "gspo", "ppo_dual_clip"):
        with pytest.raises(ValueError, match=r"missing \['advantages'\]"):
            check_inputs(name, ["target_tokens", "logprobs"])


def test_padding_contributes_nothing():
    lp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    inputs = {
        "target_tokens": torch.zeros(1, 3, dtype=torch.long),
        "logprobs": torch.tensor([[-1.5, -1.0, 0.0]]),
        "advantages": torch.tensor([[1.0, -1.0, 0.0]]),
        "weights": torch.tensor([[1.0, 1.0, 0.0]]),
        "returns": torch.tensor([[1.0, 0.5, 0.0]]),
        "values": torch.tensor([[0.2, -0.1, 0.0]]),
    }
    full = {name: fn(lp, inputs, CONFIGS.get(name, {})).loss for name, fn in BUILTIN_LOSSES.items()}
    short_inputs = {k: v[:, :2] for k, v in inputs.items()}
    for name, fn in BUILTIN_LOSSES.items():
        short = fn(lp[:, :2], short_inputs, CONFIGS.get(name, {})).loss
        assert torch.allclose(full[name], short), name


KL_LP = [-0.3, -2.0, -1.1, -0.05, -4.0]
KL_REF = [-0.3, -1.0, -2.5, -0.2, -3.5]


@pytest.mark.parametrize(
    ("name", "value", "grad"),
    [
        ("k1", lambda d, lp, ref: d, lambda d, lp, ref: 1.0),
        ("k2", lambda d, lp, ref: 0.5 * d * d, lambda d, lp, ref: d),
        (
            "k3",
            lambda d, lp, ref: math.exp(ref - lp) - 1 + d,
            lambda d, lp, ref: 1 - math.exp(ref - lp),
        ),
    ],
)
def test_kl_estimators(name, value, grad):
    """Per token, against Schulman's formulas (d = lp - ref), and d/dlp by hand."""
    lp = torch.tensor(KL_LP, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(KL_REF, dtype=torch.float64)
    kl = KL_ESTIMATORS[name](lp, ref)
    kl.sum().backward()
    pairs = list(zip(KL_LP, KL_REF, strict=True))
    expected = [value(a - b, a, b) for a, b in pairs]
    expected_grad = [grad(a - b, a, b) for a, b in pairs]
    torch.testing.assert_close(kl.detach(), torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(lp.grad, torch.tensor(expected_grad, dtype=torch.float64))
    assert kl[0] == 0  # lp == ref: no divergence, by any estimator
    if name != "k1":
        assert bool((kl >= 0).all())
