"""Core attention on `torch.nn.functional.scaled_dot_product_attention`, for Megatron layer specs.

Megatron-core's own `DotProductAttention` cannot run without CUDA: it takes its score buffer from
`parallel_state.get_global_memory_buffer()` (allocated on `torch.cuda.current_device()`) and runs
attention dropout inside `get_cuda_rng_tracker().fork()` (CUDA RNG states). `SDPACoreAttention` has
its constructor and forward signature, so it takes its place in a `ModuleSpec`
(`plait_megatron.model.layer_spec`): the rest of the layer (fused QKV projection, q/k RMSNorm,
rotary embedding, output projection, MLP) stays megatron-core's.

Masks follow Megatron's convention: `attention_mask` (b, 1, sq, sk) is True where attention is
*not* allowed; None means causal. Grouped-query attention runs without repeating keys and values.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from plait.api import ConfigError


class SDPACoreAttention(MegatronModule):
    """Drop-in for megatron-core's `DotProductAttention` (tensor parallel size 1, no dropout)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if (
            dropout
            or config.softmax_type != "vanilla"
            or config.window_size is not None
            or config.apply_query_key_layer_scaling
            or config.context_parallel_size != 1
            or config.tensor_model_parallel_size != 1
        ):
            raise ConfigError(
                "trainer.options.attention",
                "'sdpa' (SDPACoreAttention) runs plain causal softmax attention without dropout "
                "on one tensor-parallel rank",
                fix="use megatron-core's own kernels (attention = 'megatron', on CUDA) "
                "for dropout, windows, softmax offsets, query-key layer scaling or TP/CP > 1",
            )
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """query (sq, b, heads, d), key/value (sk, b, groups, d) -> context (sq, b, heads * d)."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError(
                "SDPACoreAttention takes neither attention_bias nor packed_seq_params; "
                "pass packed rows as an attention mask (plait's layouts do)"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads, s, d)
        allowed = None if attention_mask is None else ~attention_mask
        context = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=allowed,
            is_causal=allowed is None,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        sq, b = query.shape[0], query.shape[1]
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)
