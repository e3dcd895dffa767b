"""A Megatron-core GPTModel with a Hugging Face Qwen3's architecture.

Needs megatron-core (`pip install plait-megatron[megatron]`) and an initialised
`megatron.core.parallel_state` (torch.distributed first). Building works on CPU
(`use_cpu_initialization`); megatron-core 0.16's forward pass does not: RoPE moves its frequencies
to `torch.cuda.current_device()` and DotProductAttention takes its buffer from a CUDA memory pool.
"""

from __future__ import annotations

from typing import Any

import torch

from plait_megatron.convert import Qwen3Shape, Spec


def rope_theta(config: Any) -> float:
    """transformers 5 keeps it in `rope_parameters`, earlier versions as `rope_theta`."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta") or getattr(config, "rope_theta", 10000.0))


def transformer_config(hf_config: Any, *, params_dtype: torch.dtype = torch.float32, cpu: bool = False) -> Any:
    """Megatron's TransformerConfig for a transformers `Qwen3Config`."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = Qwen3Shape.of(hf_config)
    # Fusions need Transformer Engine / apex CUDA kernels; without them the same math runs unfused.
    unfused = {"bias_activation_fusion": False, "bias_dropout_fusion": False, "apply_rope_fusion": False,
               "masked_softmax_fusion": False, "persist_layer_norm": False, "gradient_accumulation_fusion": False} \
        if cpu else {}
    return TransformerConfig(
        num_layers=shape.layers, hidden_size=hf_config.hidden_size, ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=shape.heads, num_query_groups=shape.query_groups, kv_channels=shape.head_dim,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        params_dtype=params_dtype, use_cpu_initialization=cpu, **unfused)


def build_gpt_model(hf_config: Any, *, spec: Spec = "local", params_dtype: torch.dtype = torch.float32,
                    cpu: bool = False) -> Any:
    """An (untrained) GPTModel shaped like `hf_config`; load weights with `hf_to_megatron`."""
    from megatron.core.models.gpt import GPTModel

    if spec == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        layer_spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(transformer_config(hf_config, params_dtype=params_dtype, cpu=cpu), layer_spec,
                    vocab_size=hf_config.vocab_size, max_sequence_length=hf_config.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=rope_theta(hf_config),
                    share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings))
