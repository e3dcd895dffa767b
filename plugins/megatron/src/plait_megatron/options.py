"""Options of the Megatron trainer (`trainer.options` in a run config). Free of torch imports."""

from __future__ import annotations

from typing import Literal

import attrs

from plait.api import positive


@attrs.frozen
class MegatronOptions:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = the current CUDA device when there is one, else the CPU."""
    spec: Literal["auto", "local", "te"] = "auto"
    """megatron-core's layer spec: "te" (Transformer Engine's fused layers, CUDA only), "local"
    (megatron-core's own modules); auto = te when Transformer Engine imports on CUDA, else local."""
    attention: Literal["auto", "megatron", "sdpa"] = "auto"
    """The core-attention kernel: "megatron" = the spec's own (DotProductAttention, or
    TEDotProductAttention with spec te; CUDA only), "sdpa" = plait's SDPACoreAttention (torch's
    scaled_dot_product_attention; any device); auto = megatron on CUDA, sdpa on the CPU."""
    micro_batch_tokens: int = attrs.field(default=2048, validator=positive)
    """Rows x width per forward/backward pass."""
    packing: bool = True
    """Pack several sequences into one row (own position ids, no attention across them). Needs an
    attention kernel that takes arbitrary masks (sdpa, DotProductAttention; not TE's)."""
    prefix_sharing: bool = True
    """Compute positions that datums share from their start (a GRPO group's prompt) once. Same
    attention requirement as packing."""
    mixed_precision: bool = True
    """With model.dtype = bfloat16: float32 master weights and optimizer state, forward/backward
    under bfloat16 autocast. False stores the weights themselves in bfloat16."""
    threads: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive))
    """torch intra-op threads (process-wide); None keeps torch's default."""
