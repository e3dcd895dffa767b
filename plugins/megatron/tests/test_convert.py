"""Hugging Face <-> Megatron Qwen3 weights: exact round trips, the fused layouts, clear errors.
Pure torch: no megatron-core needed."""

from __future__ import annotations

import pytest
import torch

from plait.api import ModelError
from plait_megatron.convert import Qwen3Shape, hf_to_megatron, megatron_to_hf


def hf_state(model) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


@pytest.mark.parametrize("spec", ["local", "te"])
def test_round_trip_is_exact(qwen3, spec: str) -> None:
    shape = Qwen3Shape.of(qwen3.config)
    hf = hf_state(qwen3)
    megatron = hf_to_megatron(hf, shape, spec)
    assert ("output_layer.weight" in megatron) == (not qwen3.config.tie_word_embeddings)
    back = megatron_to_hf(megatron, shape, spec)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_is_interleaved_by_query_group(qwen3) -> None:
    shape = Qwen3Shape.of(qwen3.config)  # 4 heads, 2 groups, head_dim 16
    hf = hf_state(qwen3)
    fused = hf_to_megatron(hf, shape)["decoder.layers.1.self_attention.linear_qkv.weight"]
    q, k, v = (hf[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    d = 16
    assert fused.shape == ((4 + 2 * 2) * d, 64)
    group_rows = 4 * d  # 2 query heads, 1 key head, 1 value head
    for g in range(2):
        block = fused[g * group_rows : (g + 1) * group_rows]
        assert torch.equal(block[: 2 * d], q[g * 2 * d : (g + 1) * 2 * d])
        assert torch.equal(block[2 * d : 3 * d], k[g * d : (g + 1) * d])
        assert torch.equal(block[3 * d :], v[g * d : (g + 1) * d])
    fc1 = hf_to_megatron(hf, shape)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(
        fc1,
        torch.cat(
            [hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]]
        ),
    )


def test_te_spec_keeps_the_norms_in_the_fused_linears(qwen3) -> None:
    megatron = hf_to_megatron(hf_state(qwen3), Qwen3Shape.of(qwen3.config), "te")
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in megatron
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in megatron
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in megatron)
    megatron["decoder.layers.0.self_attention.linear_qkv._extra_state"] = (
        None  # TE's FP8 metadata is skipped
    )
    assert (
        megatron_to_hf(megatron, Qwen3Shape.of(qwen3.config), "te").keys() == hf_state(qwen3).keys()
    )


def test_mismatches_name_the_tensor(qwen3) -> None:
    shape = Qwen3Shape.of(qwen3.config)
    hf = hf_state(qwen3)
    missing = {k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ModelError, match=r"no 'model.layers.1.mlp.up_proj.weight'"):
        hf_to_megatron(missing, shape)
    with pytest.raises(
        ModelError, match=r"1 Hugging Face tensors do not belong to a 1-layer Qwen3"
    ):
        hf_to_megatron(hf, Qwen3Shape(1, 4, 2, 16, shape.tied_embeddings))
    with pytest.raises(ModelError, match="do not fit 4 heads in 1 groups"):
        hf_to_megatron(hf, Qwen3Shape(2, 4, 1, 16, shape.tied_embeddings))
    with pytest.raises(ModelError, match="built with the 'local' layer spec"):
        megatron_to_hf(hf_to_megatron(hf, shape, "te"), shape, "local")


def test_only_qwen3_configs_are_accepted() -> None:
    with pytest.raises(ModelError, match="converts Qwen3"):
        Qwen3Shape.of(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "hidden_size": 64,
            }
        )
    shape = Qwen3Shape.of(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "num_hidden_layers": 28,
            "hidden_size": 1024,
            "head_dim": 128,
            "tie_word_embeddings": True,
        }
    )  # Qwen3-0.6B's config.json
    assert shape == Qwen3Shape(28, 16, 8, 128, True)
