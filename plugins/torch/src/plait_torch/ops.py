"""Tensor operations the trainer and the inference engine share (so their logprobs agree)."""

from __future__ import annotations

import torch

# Logits are turned into entropies this many positions at a time (bounds the float32 copies).
_ENTROPY_CHUNK = 256


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] in float32, without materialising the full log-softmax."""
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Exact entropy of the full next-token distribution at each `selected` position (1-D),
    a few hundred positions at a time so that the float32 copies stay small."""
    rows, cols = selected.nonzero(as_tuple=True)
    out = [logits.new_zeros(0, dtype=torch.float32)]
    for start in range(0, rows.numel(), _ENTROPY_CHUNK):
        picked = logits[rows[start:start + _ENTROPY_CHUNK], cols[start:start + _ENTROPY_CHUNK]]
        logp = torch.log_softmax(picked.float(), dim=-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out)
