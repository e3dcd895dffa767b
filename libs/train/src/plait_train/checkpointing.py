"""Activation checkpointing on a Hugging Face model's decoder layers, full or selective.

- "full": a layer keeps only its input; its whole forward runs again in the backward pass.
- "selective": a layer keeps the outputs of its matmuls and attention kernels, the costly ops,
  and recomputes the cheap rest (norms, activations, rotary embeddings, elementwise products),
  which holds much of the memory at a fraction of the recompute.

Applied with `torch.distributed._composable.checkpoint`, which hooks into the layer instead of
wrapping it: parameter names stay the Hugging Face ones, and FSDP's `fully_shard` composes with it.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from plait.api import ModelError

CheckpointMode = Literal["full", "selective"]

_aten = torch.ops.aten
_KEPT_BY_SELECTIVE = frozenset(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
    )
)


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The model's repeated blocks: the modules named by its `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ModelError(
            f"cannot find the decoder layers of {type(model).__name__} (its _no_split_modules is "
            f"{sorted(names) or 'empty'})",
            fix="use a transformers model class that declares _no_split_modules",
        )
    return layers


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return (
        CheckpointPolicy.MUST_SAVE
        if op in _KEPT_BY_SELECTIVE
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


def _selective_context() -> Any:
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(model: Any, mode: CheckpointMode) -> int:
    """Checkpoint every decoder layer of `model`; returns how many layers."""
    from torch.distributed._composable import checkpoint

    if mode not in ("full", "selective"):
        raise ValueError(
            f"activation checkpointing mode must be 'full' or 'selective', got {mode!r}"
        )
    layers = decoder_layers(model)
    for layer in layers:
        if mode == "full":
            checkpoint(layer)
        else:
            checkpoint(layer, context_fn=_selective_context)
    return len(layers)
