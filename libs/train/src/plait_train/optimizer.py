"""AdamW as the single-process torch trainer engines step it.

`adamw_step` measures the gradient norm before clipping (what `optim_step` reports), skips the
update on a non-finite norm (one bad batch must not poison the weights), clips, applies the
call's `AdamParams` and always zeroes the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import structlog
import torch

from plait.api import AdamParams

log = structlog.get_logger("plait_train")


def make_adamw(params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
    """AdamW with `AdamParams()`'s defaults; every `adamw_step` sets the call's hyperparameters.

    Fused (one kernel over all parameters) where torch has it for the parameters' device: on the
    CPU the default per-tensor loop took several times longer (benchmarks/vs_minimal.py)."""
    first = AdamParams()
    params = list(params)
    fused = bool(params) and all(
        p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params
    )
    return torch.optim.AdamW(
        params,
        lr=first.learning_rate,
        betas=(first.beta1, first.beta2),
        eps=first.eps,
        weight_decay=first.weight_decay,
        fused=fused or None,
    )


def adamw_step(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], adam: AdamParams
) -> dict[str, float]:
    """One step on the accumulated gradients of `params`; returns grad_norm (before clipping),
    lr, and skipped = 1 when the norm was not finite."""
    with_grads = [p for p in params if p.grad is not None]
    if not with_grads:
        log.warning("optim_step without accumulated gradients; weights stay as they are")
    total_norm = (
        torch.nn.utils.get_total_norm([p.grad for p in with_grads if p.grad is not None])
        if with_grads
        else torch.zeros(())
    )
    grad_norm = float(total_norm)
    metrics = {"grad_norm": grad_norm, "lr": float(adam.learning_rate)}
    if not math.isfinite(grad_norm):
        log.warning("non-finite gradient norm; skipping the update", grad_norm=grad_norm)
        metrics["skipped"] = 1.0
    else:
        if adam.grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(with_grads, adam.grad_clip_norm, total_norm)
        for group in optimizer.param_groups:
            group.update(
                lr=adam.learning_rate,
                betas=(adam.beta1, adam.beta2),
                eps=adam.eps,
                weight_decay=adam.weight_decay,
            )
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return metrics
