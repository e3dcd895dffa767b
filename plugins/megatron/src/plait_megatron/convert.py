"""Qwen3 weights between Hugging Face names and Megatron-core's GPTModel names, both ways, exactly.

Megatron fuses what Hugging Face keeps apart:

- `linear_qkv` holds q, k and v interleaved by query group: for each of the `query_groups` groups,
  its `heads // query_groups` query heads, then its key head, then its value head (rows of
  `head_dim`); Hugging Face has q_proj, k_proj, v_proj.
- `linear_fc1` holds the SwiGLU gate then up projections (Hugging Face: gate_proj, up_proj).
- With Transformer Engine layer specs (what GPUs run) the norm before attention / MLP lives in the
  fused linear as `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`; with the local
  spec (what builds without TE, e.g. on CPU) they are `input_layernorm` / `pre_mlp_layernorm`.

Tensor-parallel sharding is not done here: these are full (TP = 1) tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs
import torch

from plait.api import ModelError

Spec = Literal["local", "te"]

_NORMS: dict[Spec, tuple[str, str]] = {
    "local": ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
    "te": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
}
# Per layer: Hugging Face suffix -> Megatron suffix, for the tensors that map one to one.
_SAME = {
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}


@attrs.frozen
class Qwen3Shape:
    """What the conversion needs from a Qwen3 config."""

    layers: int
    heads: int
    query_groups: int
    head_dim: int
    tied_embeddings: bool

    @classmethod
    def of(cls, config: Any) -> Qwen3Shape:
        """From a transformers `Qwen3Config` or its dict (config.json)."""

        def get(key: str, default: Any = None) -> Any:
            if isinstance(config, Mapping):
                return config.get(key, default)
            return getattr(config, key, default)

        architectures = get("architectures") or ["Qwen3ForCausalLM"]
        if get("model_type", "qwen3") != "qwen3" or "Qwen3ForCausalLM" not in architectures:
            raise ModelError(
                f"plait-megatron converts Qwen3 (dense) checkpoints, not {architectures}",
                fix="use a Qwen3ForCausalLM checkpoint, "
                "or trainer.engine = 'fsdp2' for other models",
            )
        heads = int(get("num_attention_heads"))
        groups = int(get("num_key_value_heads") or heads)
        if heads % groups:
            raise ModelError(
                f"{heads} attention heads do not split into {groups} key/value groups",
                fix="check the checkpoint's config.json",
            )
        head_dim = get("head_dim") or int(get("hidden_size")) // heads
        return cls(
            int(get("num_hidden_layers")),
            heads,
            groups,
            int(head_dim),
            bool(get("tie_word_embeddings", False)),
        )


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], shape: Qwen3Shape, spec: Spec = "local"
) -> dict[str, torch.Tensor]:
    """Megatron GPTModel state (parameter names of `spec`) from a Hugging Face Qwen3 state dict."""
    remaining = dict(hf)

    def take(name: str) -> torch.Tensor:
        try:
            return remaining.pop(name)
        except KeyError:
            raise ModelError(
                f"the Hugging Face Qwen3 weights have no {name!r}",
                fix="pass the full state dict of a Qwen3ForCausalLM matching its config",
            ) from None

    out = {
        "embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
        "decoder.final_layernorm.weight": take("model.norm.weight"),
    }
    if shape.tied_embeddings:
        remaining.pop("lm_head.weight", None)  # the same tensor as the embedding, when present
    else:
        out["output_layer.weight"] = take("lm_head.weight")
    attn_norm, mlp_norm = _NORMS[spec]
    for i in range(shape.layers):
        hf_layer, mc_layer = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (take(f"{hf_layer}self_attn.{p}_proj.weight") for p in "qkv")
        out[mc_layer + "self_attention.linear_qkv.weight"] = _interleave_qkv(q, k, v, shape)
        gate, up = take(hf_layer + "mlp.gate_proj.weight"), take(hf_layer + "mlp.up_proj.weight")
        out[mc_layer + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[mc_layer + attn_norm] = take(hf_layer + "input_layernorm.weight")
        out[mc_layer + mlp_norm] = take(hf_layer + "post_attention_layernorm.weight")
        for hf_name, mc_name in _SAME.items():
            out[mc_layer + mc_name] = take(hf_layer + hf_name)
    _no_leftovers(remaining, "Hugging Face", shape)
    return out


def megatron_to_hf(
    mc: Mapping[str, torch.Tensor], shape: Qwen3Shape, spec: Spec = "local"
) -> dict[str, torch.Tensor]:
    """The Hugging Face Qwen3 state dict (tied embeddings stored once) of a Megatron GPTModel
    state."""
    # Transformer Engine keeps FP8 metadata in `_extra_state` entries: no weights.
    remaining = {k: v for k, v in mc.items() if not k.endswith("._extra_state")}

    def take(name: str) -> torch.Tensor:
        try:
            return remaining.pop(name)
        except KeyError:
            raise ModelError(
                f"the Megatron state has no {name!r}",
                fix=f"pass a GPTModel state built with the {spec!r} layer spec for this config",
            ) from None

    out = {
        "model.embed_tokens.weight": take("embedding.word_embeddings.weight"),
        "model.norm.weight": take("decoder.final_layernorm.weight"),
    }
    if not shape.tied_embeddings:
        out["lm_head.weight"] = take("output_layer.weight")
    attn_norm, mlp_norm = _NORMS[spec]
    for i in range(shape.layers):
        hf_layer, mc_layer = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = _split_qkv(take(mc_layer + "self_attention.linear_qkv.weight"), shape)
        out.update(
            {
                f"{hf_layer}self_attn.q_proj.weight": q,
                f"{hf_layer}self_attn.k_proj.weight": k,
                f"{hf_layer}self_attn.v_proj.weight": v,
            }
        )
        gate, up = take(mc_layer + "mlp.linear_fc1.weight").chunk(2)
        out[hf_layer + "mlp.gate_proj.weight"], out[hf_layer + "mlp.up_proj.weight"] = gate, up
        out[hf_layer + "input_layernorm.weight"] = take(mc_layer + attn_norm)
        out[hf_layer + "post_attention_layernorm.weight"] = take(mc_layer + mlp_norm)
        for hf_name, mc_name in _SAME.items():
            out[hf_layer + hf_name] = take(mc_layer + mc_name)
    _no_leftovers(remaining, "Megatron", shape)
    return out


def _interleave_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: Qwen3Shape
) -> torch.Tensor:
    groups, d = shape.query_groups, shape.head_dim
    per_group = shape.heads // groups
    hidden = q.shape[-1]
    if q.shape[0] != shape.heads * d or k.shape[0] != groups * d or v.shape[0] != groups * d:
        raise ModelError(
            f"q/k/v projections of {q.shape[0]}/{k.shape[0]}/{v.shape[0]} rows do not fit "
            f"{shape.heads} heads in {groups} groups of head_dim {d}",
            fix="pass the config these weights were saved with",
        )
    fused = torch.cat(
        [
            q.reshape(groups, per_group * d, hidden),
            k.reshape(groups, d, hidden),
            v.reshape(groups, d, hidden),
        ],
        dim=1,
    )
    return fused.reshape(-1, hidden)


def _split_qkv(
    fused: torch.Tensor, shape: Qwen3Shape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = shape.query_groups, shape.head_dim
    per_group = shape.heads // groups
    hidden = fused.shape[-1]
    if fused.shape[0] != (shape.heads + 2 * groups) * d:
        raise ModelError(
            f"linear_qkv has {fused.shape[0]} rows, {shape.heads} heads in {groups} groups of "
            f"head_dim {d} need {(shape.heads + 2 * groups) * d}",
            fix="pass the config these weights were saved with",
        )
    q, k, v = fused.reshape(groups, (per_group + 2) * d, hidden).split([per_group * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _no_leftovers(remaining: Mapping[str, Any], source: str, shape: Qwen3Shape) -> None:
    if remaining:
        raise ModelError(
            f"{len(remaining)} {source} tensors do not belong to a {shape.layers}-layer Qwen3: "
            f"{sorted(remaining)[:4]}",
            fix="pass the config these weights were saved with (layer count, tied embeddings)",
        )
