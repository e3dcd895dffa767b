"""Options of the FSDP2 trainer (`trainer.options` in a run config). Free of torch imports."""

from __future__ import annotations

from typing import Literal

import attrs

from plait.api import positive


@attrs.frozen
class FSDP2Options:
    world_size: int = attrs.field(default=2, validator=positive)
    """Worker processes (ranks), one per GPU with device = "cuda"; data-parallel, parameters
    sharded."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = CUDA (NCCL, rank r on GPU r) when torch sees world_size GPUs, else CPU (gloo)."""
    micro_batch_tokens: int = attrs.field(default=2048, validator=positive)
    """Rows x width per forward/backward pass on each rank."""
    packing: bool = True
    """Pack several sequences into one row instead of padding (see plait_train.layout)."""
    prefix_sharing: bool = True
    """Compute positions that datums share from their start (a GRPO group's prompt) once; such
    datums go to the same rank. Needs sdpa or eager attention."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in the backward pass: "full" keeps only each decoder layer's input;
    "selective" keeps matmul and attention outputs and recomputes the cheap ops in between."""
    mixed_precision: bool = True
    """With model.dtype = bfloat16: float32 master weights, gradients reduced in float32, compute
    in bfloat16 (FSDP's MixedPrecisionPolicy). False keeps the weights themselves in bfloat16."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward (gather again for backward):
    less memory, one more all-gather per layer."""
    export_bucket_mb: float = attrs.field(default=256.0, validator=positive)
    """export_weights gathers and ships parameters in buckets of about this many MiB."""
    call_timeout_s: float = attrs.field(default=1800.0, validator=positive)
    """A call every rank has not answered by then fails, naming the stuck rank."""
    start_timeout_s: float = attrs.field(default=600.0, validator=positive)
    threads: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive))
    """torch threads per rank; None = the machine's cores divided among the ranks."""
    attn_implementation: Literal["sdpa", "eager"] | None = None
    """The transformers attention kernel; None lets transformers choose."""
