"""The mixture-of-experts models: tiny-qwen3-moe built offline, and sparse upcycling of a dense
Qwen3 (tiny-qwen3-moe-arith is tiny-qwen3-arith upcycled)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from plait.api import ResolvedModel
from plait_torch import models

torch = pytest.importorskip("torch")


def load(path: Path, dtype: Any = None) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32).eval()


def routed_experts(model: Any, input_ids: Any) -> tuple[Any, list[Any]]:
    """(logits, each layer's top-k expert indices per token), from hooks on the routers."""
    routes: list[Any] = []
    handles = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: routes.append(out[2]))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, routes


def test_tiny_qwen3_moe_has_the_promised_shape(tiny_moe: ResolvedModel) -> None:
    from transformers import AutoConfig

    config = json.loads((tiny_moe.path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    loaded = AutoConfig.from_pretrained(
        str(tiny_moe.path)
    )  # saved as num_local_experts, read as num_experts
    assert (loaded.num_experts, loaded.num_experts_per_tok, loaded.norm_topk_prob) == (8, 2, True)
    assert (loaded.num_hidden_layers, loaded.decoder_sparse_step, loaded.mlp_only_layers) == (
        2,
        1,
        [],
    )
    assert config["head_dim"] >= 32, "vLLM's CPU attention needs head_dim >= 32"
    assert config["vocab_size"] == 151936 and config["tie_word_embeddings"] is True
    from plait_train.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_moe.tokenizer_path)
    assert len(tokenizer) == 151669 and tokenizer.eos_token_id == 151645  # the real Qwen3 tokenizer
    assert "enable_thinking" in tokenizer.chat_template


def test_tiny_qwen3_moe_routes_every_token_to_two_experts(tiny_moe: ResolvedModel) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    model = load(tiny_moe.path)
    assert all(isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in model.model.layers)
    input_ids = torch.randint(0, 151669, (2, 12), generator=torch.Generator().manual_seed(0))
    logits, routes = routed_experts(model, input_ids)
    assert logits.shape == (2, 12, 151936) and bool(logits.isfinite().all())
    assert len(routes) == 2 and all(r.shape == (24, 2) for r in routes)
    assert len({int(e) for r in routes for e in r.flatten()}) > 2, (
        "the random routers spread tokens over experts"
    )


def test_tiny_qwen3_moe_is_deterministic(tiny_moe: ResolvedModel, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    models.build_tiny_qwen3_moe(tmp_path / "again")
    first = load_file(str(tiny_moe.path / "model.safetensors"))
    second = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert first.keys() == second.keys()
    assert all(bool((first[k] == second[k]).all()) for k in first)


def upcycle(dense: ResolvedModel, dest: Path, **settings: Any) -> Any:
    models.upcycle_qwen3_moe(dense.path, dest, **{**models.MOE_UPCYCLE, **settings})
    return load(dest)


def test_upcycling_without_noise_computes_the_dense_model(
    tiny_model: ResolvedModel, tmp_path: Path
) -> None:
    """Identical experts and renormalised top-k weights: whichever experts a token is routed to,
    the block computes the dense MLP (this also checks the gate/up order in gate_up_proj)."""
    dense = load(tiny_model.path)
    moe = upcycle(tiny_model, tmp_path / "moe", expert_noise=0.0)
    assert (
        moe.config.num_experts == 8
        and moe.config.moe_intermediate_size == dense.config.intermediate_size
    )
    input_ids = torch.randint(0, 151669, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = dense(input_ids=input_ids).logits
    logits, routes = routed_experts(moe, input_ids)
    assert len({int(e) for r in routes for e in r.flatten()}) > 2, "tokens go to different experts"
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert (tmp_path / "moe" / "tokenizer.json").is_file() and (
        tmp_path / "moe" / "generation_config.json"
    ).is_file()


def test_upcycled_experts_are_noisy_copies_of_the_dense_mlp(
    tiny_model: ResolvedModel, tmp_path: Path
) -> None:
    dense = load(tiny_model.path)
    moe = upcycle(
        tiny_model, tmp_path / "moe", expert_noise=0.1, router_std=0.05, router_shared=0.0
    )
    mlp, block = dense.model.layers[1].mlp, moe.model.layers[1].mlp
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)
    deviation = (block.experts.gate_up_proj - gate_up).pow(2).mean(dim=(1, 2)).sqrt() / gate_up.pow(
        2
    ).mean().sqrt()
    assert torch.allclose(deviation, torch.full((8,), 0.1), rtol=0.05), deviation
    assert not torch.equal(block.experts.down_proj[0], block.experts.down_proj[1])
    assert block.gate.weight.std().item() == pytest.approx(0.05, rel=0.1)


def arith_prompts(model: ResolvedModel) -> tuple[Any, list[tuple[int, int]], list[list[int]]]:
    from plait.api import Message
    from plait_hf.chat_template import ChatTemplateOptions, ChatTemplateRenderer

    renderer = ChatTemplateRenderer.from_model(
        model, options=ChatTemplateOptions(template_kwargs={"enable_thinking": False})
    )
    pairs = [(a, b) for a in range(10) for b in range(10)]
    return (
        renderer,
        pairs,
        [
            renderer.build_generation_prompt([Message("user", f"{a} + {b} =")]).to_ints()
            for a, b in pairs
        ],
    )


@pytest.mark.slow
def test_tiny_qwen3_moe_arith_knows_the_sums_and_routes_differently_in_bfloat16() -> None:
    """Greedy first-number accuracy on all 100 single-digit sums, and top-2 expert sets that differ
    between float32 and bfloat16 forwards of the same tokens (builds tiny-qwen3-arith, minutes,
    once)."""
    from plait.api import resolve_model

    resolved = resolve_model("tiny-qwen3-moe-arith")  # the model cache the learning tests use too
    renderer, pairs, prompts = arith_prompts(resolved)
    model, stop = load(resolved.path), renderer.stop_sequences()[-1]
    pad = renderer.tokenizer.pad_token_id
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=stop,
        )
    answers = [re.search(r"\d+", renderer.tokenizer.decode(row[width:])) for row in out.tolist()]
    correct = sum(
        bool(m and int(m.group()) == a + b) for m, (a, b) in zip(answers, pairs, strict=True)
    )
    assert correct >= 90, f"{correct}/100 sums right"

    sequences = torch.tensor([row for row in out.tolist() if pad not in row[width:]][:32])
    routes32 = routed_experts(model, sequences)[1]
    routes16 = routed_experts(load(resolved.path, torch.bfloat16), sequences)[1]
    differs = torch.cat(
        [
            (a.sort(-1).values != b.sort(-1).values).any(-1)
            for a, b in zip(routes32, routes16, strict=True)
        ]
    )
    assert differs.float().mean() > 0.02, (
        "float32 and bfloat16 route a few percent of tokens differently"
    )
