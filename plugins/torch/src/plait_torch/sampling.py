"""Choosing the next token of many sequences at once, each with its own sampling parameters.

Every row draws its randomness from its own generator (one uniform number per token, used by
inverse-CDF sampling), so a sequence's tokens depend on its seed and its logits only, never on
which other sequences share the batch.

The returned logprob of a token is taken from the *raw* model distribution (temperature 1, no
top-k/top-p filtering), as vLLM returns by default: it is what the trainer's forward computes for
the same token, so importance ratios compare like with like.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class RowParams:
    """Per-row sampling parameters as (B,) tensors on the logits' device."""

    temperature: torch.Tensor  # float; 0 = greedy
    top_k: torch.Tensor  # long; 0 = off
    top_p: torch.Tensor  # float; 1 = off


def choose_tokens(
    logits: torch.Tensor,
    params: RowParams,
    uniforms: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of every row and its raw logprob. `logits` (B, V); `uniforms` (B,) in [0, 1);
    `allowed` (B, V) bool, when set, the only tokens each row may choose (a grammar's mask: the
    logprob stays the raw model's, as vLLM reports it under structured outputs)."""
    raw_logits = logits.float()
    logits = raw_logits if allowed is None else raw_logits.masked_fill(~allowed, float("-inf"))
    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy = params.temperature == 0
    if bool(greedy.any()):
        tokens[greedy] = logits[greedy].argmax(-1)
    sampled = ~greedy
    if bool(sampled.any()):
        scaled = logits[sampled] / params.temperature[sampled].unsqueeze(-1)
        scaled = _top_k(scaled, params.top_k[sampled])
        scaled = _top_p(scaled, params.top_p[sampled])
        cdf = torch.softmax(scaled, dim=-1).cumsum(-1)
        # right=True picks the first token whose cumulative mass exceeds the target: never a
        # zero-mass token, as long as the target stays below the total mass (u -> 1 in float32).
        total = cdf[:, -1]
        targets = torch.minimum(
            uniforms[sampled].float() * total, torch.nextafter(total, torch.zeros_like(total))
        )
        targets = targets.unsqueeze(-1)
        tokens[sampled] = (
            torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
        )
    raw = torch.log_softmax(raw_logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, raw


def _top_k(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    rows = (top_k > 0) & (top_k < scaled.shape[-1])
    if not bool(rows.any()):
        return scaled
    ks = top_k[rows]
    kth = torch.topk(scaled[rows], int(ks.max()), dim=-1).values.gather(-1, (ks - 1).unsqueeze(-1))
    filtered = scaled[rows].masked_fill(scaled[rows] < kth, float("-inf"))
    out = scaled.clone()
    out[rows] = filtered
    return out


def _top_p(scaled: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    rows = top_p < 1
    if not bool(rows.any()):
        return scaled
    values, order = scaled[rows].sort(dim=-1, descending=True)
    probs = torch.softmax(values, dim=-1)
    # Drop a token when the tokens before it already hold top_p of the mass (the first always
    # stays).
    drop = (probs.cumsum(-1) - probs) >= top_p[rows].unsqueeze(-1)
    values = values.masked_fill(drop, float("-inf"))
    out = scaled.clone()
    out[rows] = torch.full_like(values, float("-inf")).scatter(-1, order, values)
    return out
