"""trainer.options.reference: the trainer supplies the KL penalty's ref_logprobs itself, from the
initial policy (the base with LoRA, else a frozen copy), also after a resume."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from plait.api import DataError, Datum, ResolvedModel
from plait_testing.trainer import SMOOTH_ADAM, datum_logprobs, rl_datum
from plait_torch import models
from plait_torch.options import LoraOptions, TorchTrainerOptions
from plait_torch.trainer import TorchTrainer

VOCAB = models.TINY_QWEN3_CONFIG["vocab_size"]
KL = {"kl_coef": 0.5, "kl_estimator": "k3"}


def rl_data() -> list[Datum]:
    rng = np.random.default_rng(0)
    head = rng.integers(0, VOCAB, 12).tolist()
    data = []
    for j in range(4):
        completion = rng.integers(0, VOCAB, 4 + j).tolist()
        data.append(rl_datum(head + completion, len(head), [-11.0] * len(completion), (-1.0) ** j))
    return data


def spy(trainer: TorchTrainer) -> dict[int, np.ndarray]:
    """The ref_logprobs the trainer supplies, per datum (of its latest call), as laid out."""
    seen: dict[int, np.ndarray] = {}
    runner = trainer._runner
    inner = runner._reference_logprobs

    def record(batch, backward):  # type: ignore[no-untyped-def]
        out = inner(batch, backward)
        for row, index in enumerate(batch.indices):
            seen[index] = out[row, : batch.lengths[row]].cpu().numpy()
        return out

    runner._reference_logprobs = record  # type: ignore[method-assign]
    return seen


def train(trainer: TorchTrainer, steps: int) -> None:
    for _ in range(steps):
        trainer.forward_backward(rl_data(), "importance_sampling", KL)
        trainer.optim_step(SMOOTH_ADAM)


def assert_initial(supplied: dict[int, np.ndarray], initial: list[np.ndarray]) -> None:
    assert sorted(supplied) == list(range(len(initial)))
    for index, logprobs in enumerate(initial):
        np.testing.assert_allclose(supplied[index], logprobs, atol=1e-5)


def test_with_lora_the_reference_is_the_base_model(tiny_model: ResolvedModel) -> None:
    options = TorchTrainerOptions(lora=LoraOptions(rank=4), reference=True)
    trainer = TorchTrainer(tiny_model, options=options)
    initial = datum_logprobs(TorchTrainer(tiny_model).forward(rl_data(), "importance_sampling"))
    first = trainer.forward_backward(rl_data(), "importance_sampling", KL)
    assert first.metrics["kl_ref:mean"] == pytest.approx(0.0, abs=1e-7)  # B = 0: the base
    trainer.optim_step(SMOOTH_ADAM)
    train(trainer, 3)
    supplied = spy(trainer)
    out = trainer.forward(rl_data(), "importance_sampling", KL)
    assert_initial(supplied, initial)
    assert out.metrics["kl_ref:mean"] > 1e-3
    moved = datum_logprobs(out)
    assert max(np.abs(a - b).max() for a, b in zip(moved, initial, strict=True)) > 1e-2


def test_without_lora_a_frozen_copy_keeps_the_initial_policy_across_resume(
    tiny_model: ResolvedModel, tmp_path: Path
) -> None:
    options = TorchTrainerOptions(reference=True, micro_batch_tokens=16)
    trainer = TorchTrainer(tiny_model, options=options)
    assert trainer.reference is not None
    assert not any(p.requires_grad for p in trainer.reference.parameters())
    initial = datum_logprobs(TorchTrainer(tiny_model).forward(rl_data(), "importance_sampling"))
    train(trainer, 3)
    supplied = spy(trainer)
    out = trainer.forward(rl_data(), "importance_sampling", KL)
    assert_initial(supplied, initial)
    assert out.metrics["kl_ref:mean"] > 1e-3

    trainer.save_state(tmp_path / "state")
    resumed = TorchTrainer(tiny_model, options=options)
    resumed.load_state(tmp_path / "state")
    supplied = spy(resumed)
    again = resumed.forward(rl_data(), "importance_sampling", KL)
    assert_initial(supplied, initial)  # the initial weights, not the resumed ones
    for a, b in zip(datum_logprobs(again), datum_logprobs(out), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert again.metrics["kl_ref:mean"] == pytest.approx(out.metrics["kl_ref:mean"], rel=1e-4)


def test_data_ref_logprobs_win_and_nothing_to_supply_them_is_an_error(
    tiny_model: ResolvedModel,
) -> None:
    plain = TorchTrainer(tiny_model)
    with pytest.raises(DataError, match=r"ref_logprobs") as info:
        plain.forward_backward(rl_data(), "importance_sampling", KL)
    assert "trainer.options.reference" in str(info.value.fix)
    with_ref = TorchTrainer(tiny_model, options=TorchTrainerOptions(reference=True))
    supplied = spy(with_ref)
    given = [
        Datum(
            d.model_input,
            {**d.loss_fn_inputs, "ref_logprobs": d.loss_fn_inputs["logprobs"]},
        )
        for d in rl_data()
    ]
    out = with_ref.forward(given, "importance_sampling", KL)
    assert not supplied and out.metrics["kl_ref:mean"] > 0.1  # -11s, not the policy (0)
    with_ref.forward(rl_data(), "importance_sampling")  # no kl_coef: nothing to supply
    assert not supplied
    with_ref.close()
    assert with_ref.reference is None and torch.is_grad_enabled()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_a_forward_that_supplies_ref_logprobs_outputs_each_tokens_kl(
    tiny_model: ResolvedModel, estimator: str
) -> None:
    """KL in the reward: a forward call with kl_coef gives each datum "kl_ref", the estimator's
    value at every position from the policy's logprobs and the reference's (a hand-written
    reference here); forward_backward and a call without kl_coef give none."""
    trainer = TorchTrainer(tiny_model, options=TorchTrainerOptions(reference=True))
    initial = datum_logprobs(trainer.forward(rl_data(), "importance_sampling"))
    train(trainer, 3)
    out = trainer.forward(rl_data(), "importance_sampling", {**KL, "kl_estimator": estimator})
    by_hand = {
        "k1": lambda lp, ref: lp - ref,
        "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
        "k3": lambda lp, ref: np.exp(ref - lp) - 1 - (ref - lp),
    }[estimator]
    for output, lp, ref in zip(out.loss_fn_outputs, datum_logprobs(out), initial, strict=True):
        np.testing.assert_allclose(output["kl_ref"].to_numpy(), by_hand(lp, ref), atol=1e-5)
    assert any(np.abs(o["kl_ref"].to_numpy()).max() > 1e-3 for o in out.loss_fn_outputs)
    trained = trainer.forward_backward(rl_data(), "importance_sampling", KL)
    plain = trainer.forward(rl_data(), "importance_sampling")
    assert not any("kl_ref" in o for o in [*trained.loss_fn_outputs, *plain.loss_fn_outputs])
    trainer.close()
