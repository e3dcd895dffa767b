"""plait-torch trainer specifics beyond the contract kit: metrics, dtypes, checkpoints, bad
models."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.api import AdamParams, ModelError, ResolvedModel
from plait_testing.trainer import SMOOTH_ADAM, datum_logprobs, random_tokens, rl_datum, sft_datum
from plait_torch import models
from plait_torch.options import TorchTrainerOptions
from plait_torch.trainer import TorchTrainer
from plait_train.checkpointing import decoder_layers
from plait_train.perf import peak_flops
from plait_train.scorer import TokenScorer, split_output_head

VOCAB = models.TINY_QWEN3_CONFIG["vocab_size"]


def hf_model(model: ResolvedModel):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model.path), local_files_only=True).eval()


def test_entropy_tokens_and_flops_metrics_are_exact(tiny_model: ResolvedModel) -> None:
    trainer = TorchTrainer(tiny_model, options=TorchTrainerOptions(micro_batch_tokens=16))
    lengths = (11, 7, 4)
    sequences = [random_tokens(i, n + 1, VOCAB) for i, n in enumerate(lengths)]
    weights = [[float(i % 3 != 0) for i in range(n)] for n in lengths]  # some positions inactive
    out = trainer.forward_backward(
        [sft_datum(s, w) for s, w in zip(sequences, weights, strict=True)], "cross_entropy"
    )

    reference = hf_model(tiny_model)
    entropies = []
    with torch.no_grad():
        for seq, w in zip(sequences, weights, strict=True):
            logp = torch.log_softmax(reference(torch.tensor([seq[:-1]])).logits[0].double(), -1)
            entropy = -(logp.exp() * logp).sum(-1)
            entropies += [float(e) for e, active in zip(entropy, w, strict=True) if active]
    assert out.metrics["entropy:mean"] == pytest.approx(np.mean(entropies), rel=1e-5)
    assert out.metrics["train_tokens:sum"] == sum(lengths)

    params = sum(
        p.numel() for p in reference.parameters()
    )  # tied: the output projection is the embedding
    config = reference.config
    width = config.num_attention_heads * config.head_dim
    expected = sum(n * (6 * params + 12 * config.num_hidden_layers * width * n) for n in lengths)
    assert out.metrics["model_flops:sum"] == pytest.approx(expected)
    assert trainer.flops_per_token(100) == pytest.approx(
        6 * params + 12 * config.num_hidden_layers * width * 100
    )
    forward = trainer.forward([sft_datum(s, w) for s, w in zip(sequences, weights, strict=True)])
    assert forward.metrics["model_flops:sum"] == pytest.approx(expected / 3)
    assert "train_tokens:sum" not in forward.metrics


def test_peak_flops_is_measured_once_per_process(tiny_model: ResolvedModel) -> None:
    trainer = TorchTrainer(tiny_model)
    first = trainer.peak_flops
    assert first.flops_per_s > 1e8 and first.source.startswith("measured (cpu matmul, float32")
    hits = peak_flops.cache_info().hits
    assert trainer.peak_flops_per_s == first.flops_per_s
    assert peak_flops.cache_info().hits == hits + 1


@pytest.mark.parametrize("checkpointing", [True, "selective"])
def test_activation_checkpointing_recomputes_layers_and_keeps_the_gradients(
    tiny_model: ResolvedModel, checkpointing: bool | str
) -> None:
    data = [sft_datum(random_tokens(i, 10, VOCAB)) for i in range(2)]
    norms, passes = [], []
    for setting in (False, checkpointing):
        trainer = TorchTrainer(
            tiny_model, options=TorchTrainerOptions(activation_checkpointing=setting)
        )
        calls = []
        decoder_layers(trainer.model)[0].mlp.register_forward_pre_hook(
            lambda *_, calls=calls: calls.append(1)
        )
        trainer.forward_backward(data, "cross_entropy")
        passes.append(len(calls))
        norms.append(trainer.optim_step(AdamParams()).metrics["grad_norm"])
    assert passes[1] == 2 * passes[0], "with checkpointing, the backward pass runs each layer again"
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def grpo_data(groups: int = 2, samples: int = 4, prompt: int = 24, response: int = 5) -> list:
    rng = np.random.default_rng(0)
    data = []
    for g in range(groups):
        head = rng.integers(0, VOCAB, prompt + 3 * g).tolist()
        for j in range(samples):
            completion = rng.integers(0, VOCAB, response + j).tolist()
            data.append(
                rl_datum(
                    head + completion, len(head), [-11.0 - 0.1 * j] * len(completion), (-1.0) ** j
                )
            )
    return data


def test_packing_and_prefix_sharing_train_like_padded_rows(tiny_model: ResolvedModel) -> None:
    data = grpo_data()
    runs = {}
    for name, options in {
        "padded": TorchTrainerOptions(packing=False, prefix_sharing=False),
        "packed": TorchTrainerOptions(prefix_sharing=False),
        "default": TorchTrainerOptions(),
    }.items():
        trainer = TorchTrainer(tiny_model, options=options)
        assert (trainer.capabilities.packing, trainer.capabilities.prefix_sharing) == (
            options.packing,
            options.prefix_sharing,
        )
        forward = datum_logprobs(trainer.forward(data, "ppo"))
        out = trainer.forward_backward(data, "ppo")
        norm = trainer.optim_step(SMOOTH_ADAM).metrics["grad_norm"]
        runs[name] = forward, out.metrics, norm, {n: t.clone() for n, t in trainer.export_weights()}
    padded_lp, padded_metrics, padded_norm, padded_weights = runs["padded"]
    for name in ("packed", "default"):
        lp, metrics, norm, weights = runs[name]
        for a, b in zip(padded_lp, lp, strict=True):
            np.testing.assert_allclose(b, a, atol=1e-5)
        assert metrics["loss:sum"] == pytest.approx(padded_metrics["loss:sum"], rel=1e-5)
        assert norm == pytest.approx(padded_norm, rel=1e-4)
        for key, tensor in padded_weights.items():
            torch.testing.assert_close(weights[key], tensor, rtol=1e-4, atol=1e-6)
    shared = runs["default"][1]
    # 2 groups x 4 samples: each prompt computed once instead of 4 times
    assert shared["prefix_shared_tokens:sum"] == 3 * 24 + 3 * 27
    assert shared["forward_tokens:sum"] < padded_metrics["forward_tokens:sum"] / 2


def test_bfloat16_models_keep_float32_master_weights(tiny_model: ResolvedModel) -> None:
    data = [sft_datum(random_tokens(3, 10, VOCAB))]
    full = datum_logprobs(TorchTrainer(tiny_model).forward(data))[0]
    bf16 = ResolvedModel(
        tiny_model.name, tiny_model.path, tiny_model.tokenizer_path, dtype="bfloat16"
    )
    mixed = TorchTrainer(bf16)
    assert {t.dtype for _, t in mixed.export_weights()} == {torch.float32}
    np.testing.assert_allclose(datum_logprobs(mixed.forward(data))[0], full, atol=0.1)
    pure = TorchTrainer(bf16, options=TorchTrainerOptions(mixed_precision=False))
    assert {t.dtype for _, t in pure.export_weights()} == {torch.bfloat16}
    assert np.all(np.isfinite(datum_logprobs(pure.forward(data))[0]))


def test_non_finite_gradients_skip_the_update(tiny_model: ResolvedModel) -> None:
    trainer = TorchTrainer(tiny_model)
    tokens = random_tokens(1, 9, VOCAB)
    probe = [sft_datum(tokens)]
    before = datum_logprobs(trainer.forward(probe))[0]
    trainer.forward_backward([rl_datum(tokens, 4, [-12.0] * 5, math.inf)], "importance_sampling")
    step = trainer.optim_step(AdamParams(learning_rate=1e-2))
    assert not math.isfinite(step.metrics["grad_norm"]) and step.metrics["skipped"] == 1.0
    assert step.weight_version == 1
    np.testing.assert_array_equal(datum_logprobs(trainer.forward(probe))[0], before)


def test_saved_state_is_a_hugging_face_checkpoint(
    tiny_model: ResolvedModel, tmp_path: Path
) -> None:
    trainer = TorchTrainer(tiny_model)
    trainer.forward_backward([sft_datum(random_tokens(0, 8, VOCAB))], "cross_entropy")
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    trainer.save_state(tmp_path / "state")
    reloaded = dict(
        hf_model(ResolvedModel("saved", tmp_path / "state", tiny_model.path)).named_parameters()
    )
    for name, tensor in trainer.export_weights():
        assert torch.equal(reloaded[name], tensor), name


def test_loading_something_else_is_a_clear_error(tiny_model: ResolvedModel, tmp_path: Path) -> None:
    trainer = TorchTrainer(tiny_model)
    with pytest.raises(ModelError, match="not a plait-torch trainer state"):
        trainer.load_state(tiny_model.path)
    trainer.save_state(tmp_path / "state")
    meta_path = tmp_path / "state" / "plait_trainer.json"
    meta = json.loads(meta_path.read_text())
    meta["parameters"]["model.norm.weight"] = [7]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(
        ModelError,
        match=r"different model \(or other LoRA settings\): "
        r"1 parameters differ .*model\.norm\.weight",
    ):
        trainer.load_state(tmp_path / "state")


def small_vocab_checkpoint(dest: Path, vocab: int) -> ResolvedModel:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        tie_word_embeddings=True,
    )
    Qwen3ForCausalLM(config).save_pretrained(str(dest))
    for name in models.QWEN_TOKENIZER_FILES:
        shutil.copyfile(models.qwen3_tokenizer_dir() / name, dest / name)
    return ResolvedModel("small-vocab", dest, dest)


def test_a_tokenizer_larger_than_the_embedding_fails_at_construction(tmp_path: Path) -> None:
    from plait_torch.inference import TorchInferenceEngine

    model = small_vocab_checkpoint(tmp_path / "small", 1000)
    for engine in (TorchTrainer, TorchInferenceEngine):
        with pytest.raises(ModelError) as info:
            engine(model)
        message = str(info.value)
        assert "151669 tokens" in message and "1000 embedding rows" in message
        assert info.value.fix and "tokenizer" in info.value.fix


def test_chunked_output_head_equals_the_full_logits_path(tiny_model: ResolvedModel) -> None:
    """Models whose logits are a plain projection of the decoder take the chunked output head;
    others take full logits. Both give the same logprobs, entropy and gradients."""
    data = [sft_datum(random_tokens(i, 9 + i, VOCAB)) for i in range(2)]
    results = []
    for chunked in (True, False):
        trainer = TorchTrainer(tiny_model)
        assert trainer.scorer.chunked_head
        if not chunked:
            trainer._runner.scorer = TokenScorer(trainer.model, chunked_head=False)
        out = trainer.forward_backward(data, "cross_entropy")
        results.append(
            (
                datum_logprobs(out),
                out.metrics["entropy:mean"],
                trainer.optim_step(AdamParams()).metrics["grad_norm"],
            )
        )
    (lp_a, ent_a, norm_a), (lp_b, ent_b, norm_b) = results
    for a, b in zip(lp_a, lp_b, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert ent_a == pytest.approx(ent_b, rel=1e-5) and norm_a == pytest.approx(norm_b, rel=1e-4)


def test_a_biased_output_layer_takes_the_full_logits_path(tiny_model: ResolvedModel) -> None:
    trainer = TorchTrainer(tiny_model)
    head = trainer.model.get_output_embeddings()
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    trainer.model.set_output_embeddings(biased)
    assert split_output_head(trainer.model) == (None, None)
