"""plait-torch's value model (trainer.options.value_head, a run's critic): values from the
decoder's last hidden state through a linear head, trained by the `value` loss, saved and
loaded with the weights."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import pytest
import torch

from plait.api import AdamParams, Datum, ModelInput, ResolvedModel
from plait_testing.trainer import random_tokens
from plait_torch import models
from plait_torch.options import LoraOptions, TorchTrainerOptions
from plait_torch.trainer import TorchTrainer

VOCAB = models.TINY_QWEN3_CONFIG["vocab_size"]
ADAM = AdamParams(learning_rate=3e-3)


def value_datum(tokens: Sequence[int], returns: Sequence[float], prompt_len: int = 3) -> Datum:
    """The value loss's datum: every completion position's return, weighed alike."""
    n = len(tokens) - 1
    mask = np.asarray([float(i + 1 >= prompt_len) for i in range(n)], np.float32)
    placed = np.zeros(n, np.float32)
    placed[mask > 0] = returns
    return Datum(
        ModelInput.from_ints(list(tokens[:-1])),
        {
            "target_tokens": list(tokens[1:]),
            "mask": mask,
            "returns": placed,
            "values": np.zeros(n, np.float32),
            "weights": mask / mask.sum(),
        },
    )


def values_of(trainer: TorchTrainer, data: Sequence[Datum]) -> list[np.ndarray]:
    out = trainer.forward(data, "value", {"value_clip": 0.0})
    return [o["values"].to_numpy() for o in out.loss_fn_outputs]


def data() -> list[Datum]:
    return [
        value_datum(random_tokens(0, 10, VOCAB), [1.0] * 7),
        value_datum(random_tokens(1, 8, VOCAB), [-1.0] * 5),
    ]


@pytest.mark.parametrize("lora", [None, LoraOptions(rank=4)], ids=["full", "lora"])
def test_a_new_critic_values_every_state_at_zero_and_learns_its_returns(
    tiny_model: ResolvedModel, lora: LoraOptions | None
) -> None:
    trainer = TorchTrainer(tiny_model, options=TorchTrainerOptions(value_head=True, lora=lora))
    assert trainer.capabilities.value_head
    batch = data()
    assert all(np.all(v == 0.0) for v in values_of(trainer, batch))
    errors = []
    for _ in range(15):
        out = trainer.forward_backward(batch, "value", {"value_clip": 0.0})
        errors.append(out.metrics["loss:sum"])
        trainer.optim_step(ADAM)
    assert errors[-1] < 0.2 * errors[0]
    first, second = values_of(trainer, batch)
    assert first[2:].mean() > 0.5 and second[2:].mean() < -0.5  # towards +1 and -1


def test_saved_and_loaded_with_its_head(tiny_model: ResolvedModel, tmp_path) -> None:
    trainer = TorchTrainer(tiny_model, options=TorchTrainerOptions(value_head=True))
    batch = data()
    for _ in range(3):
        trainer.forward_backward(batch, "value", {})
        trainer.optim_step(ADAM)
    trainer.save_state(tmp_path / "state")
    assert (tmp_path / "state" / "value_head.safetensors").is_file()
    expected = values_of(trainer, batch)
    again = TorchTrainer(tiny_model, options=TorchTrainerOptions(value_head=True))
    again.load_state(tmp_path / "state")
    for got, want in zip(values_of(again, batch), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert again.weight_version == trainer.weight_version


def test_values_match_the_decoder_and_head_computed_by_hand(tiny_model: ResolvedModel) -> None:
    """Packed and prefix-shared rows give each datum the values of its tokens alone."""
    trainer = TorchTrainer(tiny_model, options=TorchTrainerOptions(value_head=True))
    with torch.no_grad():
        trainer.scorer.value_head.weight.normal_()
        trainer.scorer.value_head.bias.fill_(0.3)
    shared = random_tokens(5, 6, VOCAB)
    batch = [value_datum(shared + random_tokens(i, 4, VOCAB), [0.0] * 7) for i in (6, 7)]
    decoder, head = trainer.model.get_decoder(), trainer.scorer.value_head
    with torch.no_grad():
        for datum, got in zip(batch, values_of(trainer, batch), strict=True):
            ids = torch.tensor([datum.model_input.to_ints()])
            hidden = decoder(input_ids=ids).last_hidden_state[0]
            np.testing.assert_allclose(got, head(hidden).squeeze(-1).numpy(), rtol=1e-4, atol=1e-5)


def test_a_bfloat16_critic_gives_float32_values(tiny_model: ResolvedModel) -> None:
    """Under bfloat16 autocast (mixed precision) the head still runs in float32."""
    model = attrs.evolve(tiny_model, dtype="bfloat16")
    trainer = TorchTrainer(model, options=TorchTrainerOptions(value_head=True))
    batch = data()
    for _ in range(2):
        trainer.forward_backward(batch, "value", {})
        trainer.optim_step(ADAM)
    values = values_of(trainer, batch)
    assert all(v.dtype == np.float32 and np.all(np.isfinite(v)) for v in values)
    assert values[0][2:].mean() > values[1][2:].mean()  # towards +1 and -1


def test_a_critic_has_no_reference_policy() -> None:
    with pytest.raises(ValueError, match="turn reference and routing_replay off"):
        TorchTrainerOptions(value_head=True, reference=True)
