"""LoRA in plait-torch (the trainer contract kit with LoRA is in test_contracts.py): a frozen base,
PEFT states, adapters in sampling, errors."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

from plait.api import (
    AdamParams,
    ConfigError,
    LoraConfig,
    ModelError,
    ModelInput,
    ResolvedModel,
    SamplingParams,
    structure,
)
from plait_testing.inference import run_with
from plait_testing.lora import merged_logprob, write_random_lora
from plait_testing.trainer import datum_logprobs, random_tokens, sft_datum
from plait_torch.options import LoraOptions, TorchInferenceOptions, TorchTrainerOptions
from plait_torch.trainer import ADAPTER

LORA = LoraOptions(rank=4, alpha=8.0)


def lora_trainer(model: ResolvedModel, lora: LoraOptions = LORA, **options: object):
    from plait_torch.trainer import TorchTrainer

    return TorchTrainer(model, options=TorchTrainerOptions(lora=lora, **options), seed=0)  # type: ignore[arg-type]


def sft_data(vocab: int, seed: int = 0) -> list:
    return [sft_datum(random_tokens(seed * 10 + i, 10, vocab)) for i in range(3)]


def test_only_the_adapters_train(tiny_model: ResolvedModel) -> None:
    trainer = lora_trainer(tiny_model)
    try:
        base = {
            name: p.detach().clone()
            for name, p in trainer.model.named_parameters()
            if "lora_" not in name
        }
        assert set(trainer.parameter_shapes()) == set(trainer.lora.parameters_of(ADAPTER))
        assert all(name.startswith("base_model.model.") for name in trainer.parameter_shapes())
        before = {n: t.clone() for n, t in trainer.export_weights()}
        trainer.forward_backward(sft_data(trainer.vocab_rows), "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=1e-2))
        for name, param in trainer.model.named_parameters():
            if name in base:
                assert torch.equal(param, base[name]), f"base weight {name} changed"
        after = dict(trainer.export_weights())
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        # Exported weights are merged: exactly the adapted projections move.
        assert changed and all(
            n.rsplit(".", 2)[-2]
            in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
            for n in changed
        )
    finally:
        trainer.close()


def test_attention_only_adapts_the_attention(tiny_model: ResolvedModel) -> None:
    trainer = lora_trainer(tiny_model, LoraOptions(rank=2, alpha=2.0, train_mlp=False))
    try:
        modules = {name.split(".")[-3] for name in trainer.parameter_shapes()}
        assert modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    finally:
        trainer.close()


def test_a_saved_state_is_a_peft_adapter_that_sampling_can_load(
    tiny_model: ResolvedModel, tmp_path: Path
) -> None:
    """save_state writes the adapter alone (PEFT's files); an inference engine given it as
    `options.adapter` samples with the logprobs the trainer computes."""
    from plait_torch.inference import TorchInferenceEngine

    trainer = lora_trainer(tiny_model)
    try:
        for seed in range(3):
            trainer.forward_backward(sft_data(trainer.vocab_rows, seed), "cross_entropy")
            trainer.optim_step(AdamParams(learning_rate=1e-2))
        trainer.save_state(tmp_path / "state")
        config = json.loads((tmp_path / "state" / "adapter_config.json").read_text())
        assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
        assert (tmp_path / "state" / "adapter_model.safetensors").is_file()
        assert not list((tmp_path / "state").glob("model*.safetensors")), (
            "the base model was saved too"
        )

        tokens = random_tokens(7, 9, trainer.vocab_rows)
        expected = datum_logprobs(trainer.forward([sft_datum(tokens)]))[0]
    finally:
        trainer.close()
    engine = TorchInferenceEngine(
        tiny_model, options=TorchInferenceOptions(adapter=str(tmp_path / "state"))
    )
    logprobs = run_with(lambda: engine, lambda e: e.compute_logprobs(ModelInput.from_ints(tokens)))
    np.testing.assert_allclose(logprobs[1:], expected, atol=1e-4)


def test_sampling_with_a_peft_adapter(tiny_model: ResolvedModel, tmp_path: Path) -> None:
    from plait_torch.inference import TorchInferenceEngine

    deltas = write_random_lora(tiny_model, tmp_path / "adapter")
    engine = TorchInferenceEngine(
        tiny_model, options=TorchInferenceOptions(adapter=str(tmp_path / "adapter"))
    )
    prompt = random_tokens(3, 6, 151936)
    response = run_with(
        lambda: engine,
        lambda e: e.sample(
            ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=1, stop=[], seed=1)
        ),
    )
    seq = response.sequences[0]
    assert seq.logprobs[0] == pytest.approx(
        merged_logprob(tiny_model, deltas, [*prompt, seq.tokens[0]]), abs=1e-4
    )


def test_adapters_on_one_base_train_as_if_each_were_alone(tiny_model: ResolvedModel) -> None:
    """Two adapters of one host, their calls interleaved, each ends where the same adapter ends
    trained alone on its own host; closing one leaves the other working."""
    from plait_torch.trainer import TorchTrainer

    def host() -> TorchTrainer:
        return TorchTrainer(tiny_model, options=TorchTrainerOptions(), seed=0)

    shared = host()
    a = shared.open_adapter("a", LoraConfig(rank=4, alpha=8.0), seed=1)
    b = shared.open_adapter(
        "b", LoraConfig(rank=2, alpha=4.0, train_mlp=False, train_unembed=True), seed=2
    )
    alone = host().open_adapter("a", LoraConfig(rank=4, alpha=8.0), seed=1)
    vocab = shared.vocab_rows
    for step in range(3):
        a.forward_backward(sft_data(vocab, step), "cross_entropy")
        b.forward_backward(sft_data(vocab, 10 + step), "cross_entropy")
        b.optim_step(AdamParams(learning_rate=5e-2))
        a.optim_step(AdamParams(learning_rate=1e-2))
        alone.forward_backward(sft_data(vocab, step), "cross_entropy")
        alone.optim_step(AdamParams(learning_rate=1e-2))
    probe = [sft_datum(random_tokens(7, 9, vocab))]
    np.testing.assert_allclose(
        datum_logprobs(a.forward(probe)), datum_logprobs(alone.forward(probe)), atol=1e-5
    )
    assert not np.allclose(
        datum_logprobs(b.forward(probe)), datum_logprobs(a.forward(probe)), atol=1e-3
    )
    assert (a.weight_version, b.weight_version) == (3, 3)
    b.close()
    assert set(shared.lora.adapters) == {"a"}
    np.testing.assert_allclose(
        datum_logprobs(a.forward(probe)), datum_logprobs(alone.forward(probe)), atol=1e-5
    )
    with pytest.raises(ValueError, match="exists already"):
        shared.open_adapter("a", LoraConfig(rank=4))


@pytest.mark.parametrize("loss", ["cross_entropy", "importance_sampling"])
def test_adapters_batched_in_one_pass_get_what_each_gets_alone(
    tiny_model: ResolvedModel, loss: str
) -> None:
    """forward_backward_adapters: three adapters' data (different ranks, layers and lengths) in
    shared passes give each adapter its own logprobs, loss metrics and gradients."""
    from plait_torch.trainer import TorchTrainer

    def opened() -> list:
        host = TorchTrainer(tiny_model, options=TorchTrainerOptions(micro_batch_tokens=64), seed=0)
        configs = [
            LoraConfig(rank=4, alpha=8.0),
            LoraConfig(rank=2, alpha=2.0, train_mlp=False),
            LoraConfig(rank=3, alpha=6.0, train_unembed=True),
        ]
        runs = [host.open_adapter(f"run{i}", config, seed=i) for i, config in enumerate(configs)]
        for i, run in enumerate(runs):  # make the adapters differ from the base
            run.forward_backward(sft_data(host.vocab_rows, 20 + i), "cross_entropy")
            run.optim_step(AdamParams(learning_rate=5e-2))
        return runs

    vocab = 151936
    batches = [
        [sft_datum(random_tokens(30 * g + i, 5 + 3 * i + g, vocab)) for i in range(2 + g)]
        for g in range(3)
    ]
    if loss == "importance_sampling":
        batches = [
            [
                attrs.evolve(
                    d,
                    loss_fn_inputs={
                        "target_tokens": d.loss_fn_inputs["target_tokens"],
                        "logprobs": np.full(len(d.loss_fn_inputs["weights"]), -3.0),
                        "advantages": d.loss_fn_inputs["weights"].to_numpy() - 0.5,
                    },
                )
                for d in batch
            ]
            for batch in batches
        ]
    alone, together = opened(), opened()
    expected = [
        run.forward_backward(batch, loss) for run, batch in zip(alone, batches, strict=True)
    ]
    got = together[0].host.forward_backward_adapters(
        list(zip(together, batches, strict=True)), loss
    )
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want.loss_fn_outputs, have.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(
                a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5
            )
        assert want.metrics.keys() == have.metrics.keys()
        for key in set(want.metrics) - {
            "forward_tokens:sum"
        }:  # padding included: the pass's own layout
            assert have.metrics[key] == pytest.approx(want.metrics[key], rel=1e-4, abs=1e-5), key
    for a, b in zip(alone, together, strict=True):
        for (name, p), (_, q) in zip(a._params.items(), b._params.items(), strict=True):
            # float32 sums in passes of other shapes: measured up to 7e-6 on AVX2 CPUs (grads of
            # order 1)
            torch.testing.assert_close(q.grad, p.grad, atol=2e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="distinct adapters"):
        together[0].host.forward_backward_adapters(
            [(together[0], batches[0]), (together[0], batches[1])], loss
        )


def test_an_adapter_of_the_unembedding_samples_as_it_trained(
    tiny_model: ResolvedModel, tmp_path: Path
) -> None:
    """train_unembed on a model whose unembedding is tied to its embedding: the adapter changes
    the output projection only, and an inference engine loading it (the head untied) agrees."""
    from plait_torch.inference import TorchInferenceEngine
    from plait_torch.trainer import TorchTrainer

    run = TorchTrainer(tiny_model, options=TorchTrainerOptions(), seed=0).open_adapter(
        "head", LoraConfig(rank=2, alpha=4.0, train_attn=False, train_mlp=False, train_unembed=True)
    )
    assert {name.split(".")[-3] for name in run.parameter_shapes()} == {"lm_head"}
    for step in range(3):
        run.forward_backward(sft_data(run.host.vocab_rows, step), "cross_entropy")
        run.optim_step(AdamParams(learning_rate=5e-2))
    tokens = random_tokens(7, 9, run.host.vocab_rows)
    expected = datum_logprobs(run.forward([sft_datum(tokens)]))[0]
    exported = dict(run.export_weights())
    assert "lm_head.weight" in exported
    run.save_state(tmp_path / "state")
    engine = TorchInferenceEngine(
        tiny_model, options=TorchInferenceOptions(adapter=str(tmp_path / "state"))
    )
    logprobs = run_with(lambda: engine, lambda e: e.compute_logprobs(ModelInput.from_ints(tokens)))
    np.testing.assert_allclose(logprobs[1:], expected, atol=1e-4)


def test_bad_lora_settings_and_adapters_are_clear_errors(
    tiny_model: ResolvedModel, tmp_path: Path
) -> None:
    from plait_torch.inference import TorchInferenceEngine

    with pytest.raises(ConfigError, match=r"trainer\.options\.lora: .*nothing to adapt"):
        structure(
            TorchTrainerOptions,
            {"lora": {"train_attn": False, "train_mlp": False}},
            "trainer.options",
        )
    with pytest.raises(ConfigError, match=r"trainer\.options\.lora: rank must be > 0"):
        structure(TorchTrainerOptions, {"lora": {"rank": 0}}, "trainer.options")
    assert structure(
        TorchTrainerOptions, {"lora": {"rank": 8}}, "trainer.options"
    ).lora == LoraOptions(rank=8)
    with pytest.raises(ModelError, match="not a LoRA adapter"):
        TorchInferenceEngine(tiny_model, options=TorchInferenceOptions(adapter=str(tmp_path)))
    trainer = lora_trainer(tiny_model, LoraOptions(rank=2))
    try:
        trainer.save_state(tmp_path / "rank2")
    finally:
        trainer.close()
    other = lora_trainer(tiny_model)
    try:
        with pytest.raises(ModelError, match="different model"):
            other.load_state(tmp_path / "rank2")
    finally:
        other.close()
