"""The Megatron engine against plait-torch's on the same Hugging Face weights (logprobs, losses,
gradients, a step), its weight export round trip, and its kernel choice. CPU, tiny-qwen3."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plait.api import AdamParams, ConfigError, ResolvedModel
from plait_megatron.convert import hf_to_megatron, megatron_to_hf
from plait_megatron.engine import MegatronTrainer
from plait_megatron.options import MegatronOptions
from plait_testing.trainer import datum_logprobs, random_tokens, rl_datum, sft_datum, vocab_size

pytest.importorskip("megatron.core")


def grpo_batch(vocab: int) -> list:
    """Two groups of three completions sharing their group's prompt (prefix sharing applies)."""
    data = []
    for group in range(2):
        prompt = random_tokens(50 + group, 7, vocab)
        for sample in range(3):
            completion = random_tokens(60 + 3 * group + sample, 4 + 2 * sample, vocab)
            advantage = (sample - 1) * 0.5
            data.append(
                rl_datum(prompt + completion, len(prompt), [-1.5] * len(completion), advantage)
            )
    return data


@pytest.fixture(scope="module")
def engines(tiny_model: ResolvedModel):
    pytest.importorskip("plait_torch")
    from plait_torch.options import TorchTrainerOptions
    from plait_torch.trainer import TorchTrainer

    reference = TorchTrainer(
        tiny_model, options=TorchTrainerOptions(device="cpu", attn_implementation="sdpa")
    )
    megatron = MegatronTrainer(tiny_model, options=MegatronOptions(device="cpu"))
    yield reference, megatron
    reference.close()
    megatron.close()


def assert_same_up_to_summation_order(
    actual: torch.Tensor, expected: torch.Tensor, name: str
) -> None:
    """Equal up to the rounding of float32 sums taken in another order (CPUs' kernels differ):
    an element's error is bounded by the tensor's scale, not its own size, since a gradient
    element near zero is the difference of large terms (e.g. embedding rows summed over tokens)."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=max(1e-4 * scale, 1e-6), msg=name)
    assert float((actual - expected).norm()) <= 1e-4 * float(expected.norm()) + 1e-6, name


@pytest.mark.parametrize("loss", ["cross_entropy", "ppo"])
def test_logprobs_loss_gradients_and_step_equal_plait_torch(
    engines, tiny_model: ResolvedModel, loss: str
) -> None:
    reference, megatron = engines
    vocab = vocab_size(tiny_model)
    data = (
        grpo_batch(vocab)
        if loss == "ppo"
        else [sft_datum(random_tokens(i, 9 + 3 * i, vocab)) for i in range(4)]
    )
    for lp_ref, lp_mg in zip(
        datum_logprobs(reference.forward(data, loss)),
        datum_logprobs(megatron.forward(data, loss)),
        strict=True,
    ):
        np.testing.assert_allclose(lp_mg, lp_ref, atol=2e-5)

    out_ref, out_mg = reference.forward_backward(data, loss), megatron.forward_backward(data, loss)
    assert out_mg.metrics["loss:sum"] == pytest.approx(
        out_ref.metrics["loss:sum"], rel=1e-5, abs=1e-6
    )
    assert out_mg.metrics["prefix_shared_tokens:sum"] == out_ref.metrics["prefix_shared_tokens:sum"]
    grads_mg = megatron_to_hf(
        {n: p.grad for n, p in megatron.gpt.named_parameters()}, megatron.shape
    )
    grads_ref = {n: p.grad for n, p in reference.model.named_parameters()}
    assert grads_mg.keys() == grads_ref.keys()
    for name, grad in grads_ref.items():
        assert_same_up_to_summation_order(grads_mg[name], grad, name)

    # Adam's large eps keeps the update smooth in the gradient (as the contract kit's SMOOTH_ADAM):
    # with a small eps, gradients of ~0 that differ in rounding would move weights by +-lr.
    adam = AdamParams(learning_rate=1e-1, eps=1.0, grad_clip_norm=1.0)
    step_ref, step_mg = reference.optim_step(adam), megatron.optim_step(adam)
    assert step_mg.metrics["grad_norm"] == pytest.approx(step_ref.metrics["grad_norm"], rel=1e-5)
    exported = dict(megatron.export_weights())
    for name, weight in reference.export_weights():
        torch.testing.assert_close(exported[name], weight, rtol=0, atol=1e-6, msg=name)


def test_exported_and_saved_weights_are_a_hugging_face_model(
    tiny_model: ResolvedModel, tmp_path
) -> None:
    """After a step: the exported weights convert back to the live Megatron parameters exactly, and
    the saved state is a transformers checkpoint that scores like the engine."""
    from transformers import AutoModelForCausalLM

    vocab = vocab_size(tiny_model)
    data = [sft_datum(random_tokens(i, 12, vocab)) for i in range(3)]
    engine = MegatronTrainer(tiny_model, options=MegatronOptions(device="cpu"))
    try:
        engine.forward_backward(data, "cross_entropy")
        engine.optim_step(AdamParams(learning_rate=1e-2))
        exported = {name: tensor.clone() for name, tensor in engine.export_weights()}
        back = hf_to_megatron(exported, engine.shape)
        live = dict(engine.gpt.named_parameters())
        assert back.keys() == live.keys()
        assert all(torch.equal(back[name], live[name].detach()) for name in live)

        engine.save_state(tmp_path / "state")
        hf = AutoModelForCausalLM.from_pretrained(
            str(tmp_path / "state"), attn_implementation="sdpa"
        ).eval()
        hf_weights = dict(hf.state_dict())
        for name, tensor in exported.items():
            assert torch.equal(hf_weights[name], tensor), name
        tokens = random_tokens(7, 13, vocab)
        with torch.no_grad():
            logits = hf(torch.tensor([tokens[:-1]])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[torch.arange(12), torch.tensor(tokens[1:])].numpy()
        np.testing.assert_allclose(
            datum_logprobs(engine.forward([sft_datum(tokens)]))[0], expected, atol=2e-5
        )
    finally:
        engine.close()


def test_cuda_only_kernels_are_refused_on_the_cpu(tiny_model: ResolvedModel) -> None:
    for options in (
        MegatronOptions(device="cpu", attention="megatron"),
        MegatronOptions(device="cpu", spec="te"),
    ):
        with pytest.raises(ConfigError, match="need CUDA"):
            MegatronTrainer(tiny_model, options=options)
