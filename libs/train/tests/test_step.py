"""plait_train's step, scorer and checkpointing on a small random Qwen3
(needs torch + transformers).

Packed and prefix-shared layouts must give the logprobs and gradients of the padded one; the
entropy bonus adds exactly its formula's gradient; a sequence-level loss sees each datum whole.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from plait.api import DataError, Datum, TensorData  # noqa: E402
from plait_testing.trainer import rl_datum, sft_datum  # noqa: E402
from plait_train.checkpointing import apply_activation_checkpointing, decoder_layers  # noqa: E402
from plait_train.layout import LayoutOptions, plan_rows  # noqa: E402
from plait_train.perf import FlopsModel  # noqa: E402
from plait_train.scorer import TokenScorer  # noqa: E402
from plait_train.step import StepRunner, split_loss_config, to_output  # noqa: E402

VOCAB = 97
PADDED = LayoutOptions(64)
LAYOUTS = {
    "packed": LayoutOptions(64, packing=True),
    "shared": LayoutOptions(64, prefix_sharing=True),
    "packed+shared": LayoutOptions(64, packing=True, prefix_sharing=True),
    "shared, small rows": LayoutOptions(24, packing=True, prefix_sharing=True),
}


def small_qwen3(attention: str) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        attn_implementation=attention,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).train()


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return small_qwen3(request.param)


def rl_batch() -> list[Datum]:
    """Two GRPO groups (4 and 3 samples), a second turn that extends a first one, a duplicate."""
    rng = np.random.default_rng(1)
    data = []
    for group, (prompt_len, samples) in enumerate(((9, 4), (6, 3))):
        prompt = rng.integers(0, VOCAB, prompt_len).tolist()
        for j in range(samples):
            response = rng.integers(0, VOCAB, 2 + j).tolist()
            data.append(
                rl_datum(
                    prompt + response,
                    prompt_len,
                    (-1.5 - 0.1 * rng.random(len(response))).tolist(),
                    advantage=(-1.0) ** (j + group),
                )
            )
    first = [
        *data[0].model_input.to_ints(),
        int(data[0].loss_fn_inputs["target_tokens"].to_numpy()[-1]),
    ]
    second = first + rng.integers(0, VOCAB, 5).tolist()
    data.append(
        rl_datum(second, len(first) + 2, [-2.0] * (len(second) - len(first) - 2), advantage=0.5)
    )
    data.append(data[2])
    return data


def run(
    model: torch.nn.Module,
    layout: LayoutOptions,
    data: list[Datum],
    *,
    backward: bool,
    chunked: bool = True,
    loss: str = "ppo",
    config: Mapping[str, float | str] | None = None,
    **kwargs: object,
) -> tuple[list[np.ndarray], dict[str, float], dict[str, torch.Tensor]]:
    runner = StepRunner(
        TokenScorer(model, chunked_head=chunked),
        layout=layout,
        device=torch.device("cpu"),
        flops=FlopsModel.of(model),
        vocab_rows=VOCAB,
    )
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        result = runner.run(data, loss, config, backward=backward, **kwargs)
    out = to_output(loss, len(data), [(range(len(data)), result)])
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs], out.metrics, grads


def assert_same_gradients(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]
) -> None:
    assert expected.keys() == actual.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(
            actual[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked head", "full logits"])
def test_layouts_give_the_padded_logprobs_and_gradients(
    model: torch.nn.Module, layout: str, chunked: bool
) -> None:
    data = rl_batch()
    forward, _, _ = run(model, PADDED, data, backward=False, chunked=chunked)
    trained, metrics, grads = run(model, PADDED, data, backward=True, chunked=chunked)
    forward_l, _, _ = run(model, LAYOUTS[layout], data, backward=False, chunked=chunked)
    trained_l, metrics_l, grads_l = run(
        model, LAYOUTS[layout], data, backward=True, chunked=chunked
    )
    for a, b in zip(forward, forward_l, strict=True):
        np.testing.assert_allclose(b, a, atol=2e-5)
    for a, b in zip(trained, trained_l, strict=True):
        np.testing.assert_allclose(b, a, atol=2e-5)
    assert grads, "the loss reached no parameter"
    assert_same_gradients(grads, grads_l)
    for key in ("loss:sum", "entropy:mean", "importance_weight:max", "train_tokens:sum"):
        assert metrics_l[key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    if LAYOUTS[layout].prefix_sharing:
        assert metrics_l["prefix_shared_tokens:sum"] > 0
        assert metrics_l["model_flops:sum"] < metrics["model_flops:sum"]
    assert metrics_l["forward_tokens:sum"] < metrics["forward_tokens:sum"]


def test_sharing_computes_a_group_prompt_once(model: torch.nn.Module) -> None:
    prompt = list(range(1, 41))
    data = [sft_datum([*prompt, 50 + j, 60 + j]) for j in range(8)]
    _, metrics, _ = run(model, LAYOUTS["packed+shared"], data, backward=True, loss="cross_entropy")
    # inputs are prompt + one response token (the datum's last token is only a target)
    assert metrics["forward_tokens:sum"] == 40 + 8
    assert metrics["prefix_shared_tokens:sum"] == 7 * 40
    assert metrics["train_tokens:sum"] == 8 * 41


def test_dummy_passes_change_nothing(model: torch.nn.Module) -> None:
    data = rl_batch()
    logprobs, metrics, grads = run(model, LAYOUTS["packed+shared"], data, backward=True)
    passes = []
    logprobs_d, metrics_d, grads_d = run(
        model,
        LAYOUTS["packed+shared"],
        data,
        backward=True,
        agree_on_passes=lambda n: passes.append(n) or n + 2,
    )
    assert passes and passes[0] >= 1
    for a, b in zip(logprobs, logprobs_d, strict=True):
        np.testing.assert_array_equal(a, b)
    assert metrics == metrics_d
    assert_same_gradients(grads, grads_d)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_and_keeps_the_gradients(
    model: torch.nn.Module, mode: str
) -> None:
    data = rl_batch()
    _, _, expected = run(model, LAYOUTS["packed+shared"], data, backward=True)
    checkpointed = copy.deepcopy(model)
    assert apply_activation_checkpointing(checkpointed, mode) == 2
    runner = StepRunner(
        TokenScorer(checkpointed),
        layout=LAYOUTS["packed+shared"],
        device=torch.device("cpu"),
        flops=FlopsModel.of(checkpointed),
        vocab_rows=VOCAB,
    )
    calls = []
    # A pre-hook: recomputation stops as soon as the last saved tensor is back, before the MLP ends.
    decoder_layers(checkpointed)[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        runner.run(data, "ppo", None, backward=False)
    forward_passes = len(calls)
    calls.clear()
    runner.run(data, "ppo", None, backward=True)
    assert len(calls) == 2 * forward_passes, (
        "every forward of the layer runs again in the backward pass"
    )
    grads = {n: p.grad.clone() for n, p in checkpointed.named_parameters() if p.grad is not None}
    assert_same_gradients(expected, grads)


def test_parameter_names_stay_hugging_face_names(model: torch.nn.Module) -> None:
    before = [n for n, _ in model.named_parameters()]
    checkpointed = copy.deepcopy(model)
    apply_activation_checkpointing(checkpointed, "full")
    assert [n for n, _ in checkpointed.named_parameters()] == before
    assert [n for n, _ in TokenScorer(checkpointed).named_parameters()] == [
        f"model.{n}" for n in before
    ]


def entropy_bonus_gradients(
    model: torch.nn.Module, data: list[Datum], coef: float
) -> dict[str, torch.Tensor]:
    """The gradient of -coef * (sum of the entropy over the loss's positions) / (their number in
    all of `data`), by autograd through each datum's full logits, alone."""
    positions = sum(int((d.loss_fn_inputs["mask"].to_numpy() > 0).sum()) for d in data)
    model.zero_grad(set_to_none=True)
    for datum in data:
        logits = model(input_ids=torch.tensor([datum.model_input.to_ints()])).logits[0]
        logp = torch.log_softmax(logits.float(), -1)
        entropy = -(logp.exp() * logp).sum(-1)
        mask = torch.from_numpy(datum.loss_fn_inputs["mask"].to_numpy()) > 0
        (-coef * entropy[mask].sum() / positions).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("layout", ["padded", "packed+shared"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked head", "full logits"])
def test_entropy_coef_adds_the_entropy_bonus_gradient(
    model: torch.nn.Module, layout: str, chunked: bool
) -> None:
    """Over several micro-batches (the bonus is the call's mean, not a micro-batch's), with a
    loss that takes no entropy_coef of its own."""
    data, coef = rl_batch(), 0.3
    options = PADDED if layout == "padded" else LAYOUTS[layout]
    _, metrics, grads = run(model, options, data, backward=True, chunked=chunked)
    _, metrics_b, grads_b = run(
        model, options, data, backward=True, chunked=chunked, config={"entropy_coef": coef}
    )
    assert "entropy_bonus:sum" not in metrics
    assert metrics_b["entropy_bonus:sum"] == pytest.approx(-coef * metrics["entropy:mean"])
    assert metrics_b["loss:sum"] == pytest.approx(metrics["loss:sum"])
    bonus = entropy_bonus_gradients(model, data, coef)
    assert_same_gradients(bonus, {n: grads_b[n] - grads[n] for n in bonus})


def test_entropy_coef_must_be_a_number(model: torch.nn.Module) -> None:
    with pytest.raises(DataError, match=r"loss_fn_config\[.entropy_coef.\] is nan") as info:
        run(model, PADDED, rl_batch(), backward=True, config={"entropy_coef": float("nan")})
    assert "leave it out for no entropy bonus" in (info.value.fix or "")


def hand_kl(lp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Schulman's estimators written out (d = lp - ref), independently of plait_train.losses."""
    d = lp - ref
    return {"k1": d, "k2": 0.5 * d**2, "k3": torch.exp(-d) - 1 + d}[estimator]


def with_ref_logprobs(model: torch.nn.Module, data: list[Datum]) -> list[Datum]:
    """rl_batch with a reference policy's logprobs: the model's own, shifted by up to +-0.5 per
    token on the trained positions, 0 elsewhere."""
    logprobs, _, _ = run(model, PADDED, data, backward=False)
    rng = np.random.default_rng(7)
    out = []
    for datum, lp in zip(data, logprobs, strict=True):
        mask = datum.loss_fn_inputs["mask"].to_numpy()
        ref = np.where(mask > 0, lp + rng.uniform(-0.5, 0.5, lp.shape), 0.0).astype(np.float32)
        out.append(Datum(datum.model_input, {**datum.loss_fn_inputs, "ref_logprobs": ref}))
    return out


def kl_penalty_reference(
    model: torch.nn.Module, data: list[Datum], coef: float, estimator: str
) -> tuple[float, dict[str, torch.Tensor]]:
    """The mean estimated KL over the loss's positions, and the gradient of coef * (its sum) /
    (their number in all of `data`), by autograd through each datum's full logits, alone."""
    positions = sum(int((d.loss_fn_inputs["mask"].to_numpy() > 0).sum()) for d in data)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for datum in data:
        logits = model(input_ids=torch.tensor([datum.model_input.to_ints()])).logits[0]
        targets = torch.from_numpy(datum.loss_fn_inputs["target_tokens"].to_numpy()).long()
        lp = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0]
        ref = torch.from_numpy(datum.loss_fn_inputs["ref_logprobs"].to_numpy()).float()
        mask = torch.from_numpy(datum.loss_fn_inputs["mask"].to_numpy()) > 0
        kl = hand_kl(lp[mask], ref[mask], estimator).sum()
        total += float(kl.detach())
        (coef * kl / positions).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total / positions, grads


@pytest.mark.parametrize(
    ("layout", "estimator"), [("padded", "k1"), ("padded", "k2"), ("packed+shared", "k3")]
)
def test_kl_coef_adds_the_kl_penalty_gradient(
    model: torch.nn.Module, layout: str, estimator: str
) -> None:
    """kl_coef * (sum of the estimated KL over the loss's positions) / (their number in the whole
    call), over several micro-batches; kl_ref:mean is reported with ref_logprobs alone too."""
    data, coef = with_ref_logprobs(model, rl_batch()), 0.4
    options = PADDED if layout == "padded" else LAYOUTS[layout]
    config: dict[str, float | str] = {"kl_estimator": estimator}
    _, metrics, grads = run(model, options, data, backward=True, config=config)
    _, metrics_kl, grads_kl = run(
        model, options, data, backward=True, config={**config, "kl_coef": coef}
    )
    mean, penalty = kl_penalty_reference(model, data, coef, estimator)
    assert "kl_penalty:sum" not in metrics
    assert metrics["kl_ref:mean"] == pytest.approx(mean, rel=1e-4, abs=1e-6)
    assert metrics_kl["kl_ref:mean"] == pytest.approx(mean, rel=1e-4, abs=1e-6)
    assert metrics_kl["kl_penalty:sum"] == pytest.approx(coef * mean, rel=1e-4, abs=1e-6)
    assert metrics_kl["loss:sum"] == pytest.approx(metrics["loss:sum"])
    assert_same_gradients(penalty, {n: grads_kl[n] - grads[n] for n in penalty})


def test_kl_coef_needs_ref_logprobs(model: torch.nn.Module) -> None:
    with pytest.raises(DataError, match=r"kl_coef.*loss_fn_inputs\['ref_logprobs'\]") as info:
        run(model, PADDED, rl_batch(), backward=True, config={"kl_coef": 0.1})
    assert "reference policy's logprob of each target token" in (info.value.fix or "")


def test_kl_estimator_must_be_known(model: torch.nn.Module) -> None:
    data = with_ref_logprobs(model, rl_batch()[:2])
    with pytest.raises(DataError, match=r"loss_fn_config\[.kl_estimator.\] is 'k4'") as info:
        run(model, PADDED, data, backward=True, config={"kl_coef": 0.1, "kl_estimator": "k4"})
    assert "'k1', 'k2' or 'k3'" in (info.value.fix or "")
    with pytest.raises(DataError, match=r"loss_fn_config\[.kl_coef.\] is nan"):
        run(model, PADDED, data, backward=True, config={"kl_coef": float("nan")})
    assert split_loss_config({"kl_coef": 0.1, "kl_estimator": 2})[1].kl_estimator == "k2"
    assert split_loss_config({"ppo_x": 1.0})[1].kl_estimator == "k3"


def near_policy_batch(model: torch.nn.Module) -> list[Datum]:
    """rl_batch with sampler logprobs the model's own shifted by a few 1e-4 per datum, so that
    GSPO's sequence ratios fall inside its clip range (3e-4 below 1, 4e-4 above) and out."""
    data = rl_batch()
    logprobs, _, _ = run(model, PADDED, data, backward=False)
    shifts = [1e-4, -2e-4, 2e-3, -1e-3, 3e-4, -5e-3, 0.05, -0.05, 0.0]
    out = []
    for datum, lp, shift in zip(data, logprobs, shifts, strict=True):
        mask = datum.loss_fn_inputs["mask"].to_numpy()
        sampler = np.where(mask > 0, lp - shift, 0.0).astype(np.float32)
        inputs = {**datum.loss_fn_inputs, "logprobs": TensorData.from_numpy(sampler)}
        out.append(Datum(datum.model_input, inputs))
    return out


def test_gspo_on_packed_datums_equals_each_datum_alone(model: torch.nn.Module) -> None:
    data = near_policy_batch(model)
    tokens = [np.asarray(d.model_input.to_ints()) for d in data]
    assert any(len(row.members) > 1 for row in plan_rows(tokens, LAYOUTS["packed"]))
    _, metrics, grads = run(model, LAYOUTS["packed"], data, backward=True, loss="gspo")
    assert 0 < metrics["clip_fraction:mean"] < 1
    loss, summed = 0.0, {n: torch.zeros_like(g) for n, g in grads.items()}
    for datum in data:
        _, alone, alone_grads = run(model, PADDED, [datum], backward=True, loss="gspo")
        loss += alone["loss:sum"]
        for name, grad in alone_grads.items():
            summed[name] += grad
    assert metrics["loss:sum"] == pytest.approx(loss, rel=1e-5)
    assert_same_gradients(summed, grads)
    _, padded, padded_grads = run(model, PADDED, data, backward=True, loss="gspo")
    assert padded["loss:sum"] == pytest.approx(loss, rel=1e-5)
    assert_same_gradients(padded_grads, grads)
