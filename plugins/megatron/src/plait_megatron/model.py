"""A Megatron-core GPTModel with a Hugging Face Qwen3's architecture.

Needs megatron-core (`pip install plait-megatron[megatron]`) and an initialised
`megatron.core.parallel_state` (torch.distributed first). `layer_spec` builds megatron-core's own
layer spec (local or Transformer Engine) and can put another core-attention module in it:
megatron-core 0.16's `DotProductAttention` needs CUDA, `plait_megatron.attention.SDPACoreAttention`
runs anywhere. Rotary embeddings are computed from position ids by `plait_megatron.scorer`, so
megatron-core's `RotaryEmbedding.forward` (which moves its frequencies to the current CUDA device)
never runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from plait_megatron.convert import Qwen3Shape, Spec


def rope_theta(config: Any) -> float:
    """transformers 5 keeps it in `rope_parameters`, earlier versions as `rope_theta`."""
    parameters: Mapping[str, Any] = getattr(config, "rope_parameters", None) or {}
    theta = parameters.get("rope_theta")
    return float(theta if theta else getattr(config, "rope_theta", 10000.0))


def transformer_config(
    hf_config: Any,
    *,
    params_dtype: torch.dtype = torch.float32,
    cpu: bool = False,
    initialize: bool = True,
) -> Any:
    """Megatron's TransformerConfig for a transformers `Qwen3Config`. `cpu`: build the weights on
    the CPU (else on the current CUDA device); `initialize=False` leaves them uninitialised, for
    weights that are loaded right after."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = Qwen3Shape.of(hf_config)
    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=shape.heads,
        num_query_groups=shape.query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        params_dtype=params_dtype,
        use_cpu_initialization=cpu,
        perform_initialization=initialize,
    )


def layer_spec(spec: Spec = "local", core_attention: type | None = None) -> Any:
    """megatron-core's transformer layer spec for Qwen3 (RMSNorm, q/k norms), with
    `core_attention` in place of its own attention kernel when given."""
    from megatron.core.models.gpt import gpt_layer_specs

    if spec == "te":
        built = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    else:
        built = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    if core_attention is None:
        return built
    attention = built.submodules.self_attention
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, core_attention=core_attention),
    )
    return dataclasses.replace(
        built, submodules=dataclasses.replace(built.submodules, self_attention=attention)
    )


def build_gpt_model(
    hf_config: Any,
    *,
    spec: Spec = "local",
    params_dtype: torch.dtype = torch.float32,
    cpu: bool = False,
    core_attention: type | None = None,
    initialize: bool = True,
) -> Any:
    """A GPTModel shaped like `hf_config`; load weights with `hf_to_megatron`."""
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(
        hf_config, params_dtype=params_dtype, cpu=cpu, initialize=initialize
    )
    return GPTModel(
        config,
        layer_spec(spec, core_attention),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
    )
