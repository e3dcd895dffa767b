"""Tensor operations every torch trainer and inference engine share (so their logprobs agree).

`head_logprobs` is the trainer's output layer: target logprobs and exact entropies straight from
the last hidden states and the output projection, a few dozen positions at a time, so the full
(tokens x vocab) logits are never materialised. For small models with large vocabularies (Qwen's
151936) those logits and their gradient are most of a step's memory traffic; chunking keeps each
piece in cache and recomputes the projection in the backward pass instead of storing it.

Entropies are differentiable too, on this path and the full-logits one (`token_entropy`); their
gradient is computed only when the entropy reaches the loss (an entropy bonus), and costs nothing
otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Positions per chunk of the output head: about this many bytes of float32 logits at a time.
_CHUNK_BYTES = 32 * 2**20


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] in float32, without materialising the full log-softmax."""
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def chunk_rows(vocab: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * vocab))


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    low_rank: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logprobs and entropies of `hidden @ weight.T`, in float32, both differentiable.

    `hidden` (N, H) final hidden states, `weight` (V, H) the output projection, `targets` (N,).
    `low_rank`: LoRA adapters on the projection, as (rows, u, b): the logits of positions `rows`
    gain `u @ b.T`, where `u` (len(rows), r) is the scaled down-projection `s * A h` and `b`
    (V, r) the up-projection; the base projection stays one matmul for every position.
    """
    flat = [tensor for part in low_rank for tensor in part]
    return _HeadLogprobs.apply(hidden, weight, targets, *flat)


def _runs(flat: Sequence[torch.Tensor]) -> list[tuple[int, int, int, int]]:
    """The low-rank parts as runs of consecutive positions: (part index, first position, end
    position, the row of `u` for the first position). The parts' rows are positions in order of
    their datums, so a part is a few long runs, and the chunks add each in place, on a slice of
    their logits, instead of scattering a copy (positions x vocab) of them."""
    runs = []
    for k in range(0, len(flat), 3):
        rows = flat[k].cpu()
        if not len(rows):
            continue
        starts = [0, *((rows[1:] != rows[:-1] + 1).nonzero().squeeze(-1) + 1).tolist()]
        ends = [*starts[1:], len(rows)]
        first = rows[starts].tolist()
        runs += [(k // 3, r, r + e - s, s) for r, s, e in zip(first, starts, ends, strict=True)]
    return runs


def _chunk_runs(
    runs: Sequence[tuple[int, int, int, int]], start: int, end: int
) -> list[tuple[int, int, int, int]]:
    """The runs' pieces in positions [start, end): (part index, first and end position within
    the chunk, the row of `u` for the first)."""
    pieces = []
    for k, first, last, row in runs:
        lo, hi = max(first, start), min(last, end)
        if lo < hi:
            pieces.append((k, lo - start, hi - start, row + lo - first))
    return pieces


def _chunk_logits(
    h: torch.Tensor,
    w: torch.Tensor,
    flat: Sequence[torch.Tensor],
    runs: Sequence[tuple[int, int, int, int]],
    start: int,
    end: int,
) -> torch.Tensor:
    logits = h @ w.T
    for k, lo, hi, row in _chunk_runs(runs, start, end):
        u, b = flat[3 * k + 1][row : row + hi - lo].float(), flat[3 * k + 2].float()
        logits[lo:hi].addmm_(u, b.T)  # in place: never copy the chunk's (positions x vocab) logits
    return logits


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        *flat: torch.Tensor,
    ) -> Any:
        rows = chunk_rows(weight.shape[0])
        n = hidden.shape[0]
        ctx.runs = runs = _runs(flat)
        logprobs = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.float()
            for start in range(0, n, rows):
                end = min(start + rows, n)
                logits = _chunk_logits(hidden[start:end].float(), w, flat, runs, start, end)
                shift = logits.amax(-1, keepdim=True)
                logits.sub_(shift)
                exp = logits.exp()
                total = exp.sum(-1)
                log_total = total.log()
                logprobs[start:end] = (
                    logits.gather(-1, targets[start:end, None]).squeeze(-1) - log_total
                )
                # H = log Z - sum(p * x), shift-invariant; p = exp / Z
                entropy[start:end] = log_total - (exp * logits).sum(-1) / total
                lse[start:end] = log_total + shift.squeeze(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, *flat)
        # An output that reaches no loss gets None, not zeros: the entropy's gradient then costs
        # nothing.
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> Any:
        hidden, weight, targets, lse, entropy, *flat = ctx.saved_tensors
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows = chunk_rows(weight.shape[0])
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Of each low-rank part (rows, u, b), u and b take gradients; rows are indices.
        grad_u = [torch.zeros_like(u, dtype=torch.float32) for u in flat[1::3]]
        grad_b = [torch.zeros_like(b, dtype=torch.float32) for b in flat[2::3]]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.float()
            grad_weight = torch.zeros_like(w) if need_weight else None
            for start in range(0, hidden.shape[0], rows):
                end = min(start + rows, hidden.shape[0])
                h = hidden[start:end].float()
                g = grad_logprobs[start:end].float()
                logp = _chunk_logits(h, w, flat, ctx.runs, start, end).sub_(lse[start:end, None])
                # d logprob / d logits = onehot(target) - p; d entropy / d logits = -p (log p + H)
                if grad_entropy is None:
                    grad_logits = logp.exp_().mul_(-g[:, None])
                else:
                    p = logp.exp()
                    grad_logits = (
                        logp.add_(entropy[start:end, None])
                        .mul_(grad_entropy[start:end, None].float())
                        .add_(g[:, None])
                        .mul_(p)
                        .neg_()
                    )
                grad_logits[torch.arange(end - start, device=h.device), targets[start:end]] += g
                if grad_hidden is not None:
                    grad_hidden[start:end] = (grad_logits @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.addmm_(grad_logits.T, h)
                for k, lo, hi, row in _chunk_runs(ctx.runs, start, end):
                    u, b, mine = flat[3 * k + 1], flat[3 * k + 2], grad_logits[lo:hi]
                    grad_u[k][row : row + hi - lo].addmm_(mine, b.float())
                    grad_b[k].addmm_(mine.T, u[row : row + hi - lo].float())
        grad_flat: list[torch.Tensor | None] = [
            grad for k in range(len(grad_u)) for grad in (None, grad_u[k], grad_b[k])
        ]
        grads = [None if g is None else g.to(t.dtype) for g, t in zip(grad_flat, flat, strict=True)]
        return (
            grad_hidden,
            (grad_weight.to(weight.dtype) if grad_weight is not None else None),
            None,
            *grads,
        )


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Exact entropy of the next-token distribution of each row of `logits` (N, V), in float32,
    a few dozen rows at a time so that the float32 copies stay small. Differentiable: the
    backward recomputes each chunk's softmax (and runs only when the entropy reaches a loss)
    instead of autograd keeping (N, V) intermediates for it."""
    return _TokenEntropy.apply(logits)


class _TokenEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor) -> Any:
        step = chunk_rows(logits.shape[-1])
        entropy = logits.new_empty(logits.shape[0], dtype=torch.float32)
        for start in range(0, logits.shape[0], step):
            logp = torch.log_softmax(logits[start : start + step].float(), dim=-1)
            entropy[start : start + step] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits, entropy)
        return entropy

    @staticmethod
    def backward(ctx: Any, grad_entropy: torch.Tensor) -> Any:
        logits, entropy = ctx.saved_tensors
        step = chunk_rows(logits.shape[-1])
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], step):
            end = min(start + step, logits.shape[0])
            logp = torch.log_softmax(logits[start:end].float(), dim=-1)
            p = logp.exp()
            # d entropy / d logits = -p (log p + H)
            grad_logits[start:end] = p.mul_(logp.add_(entropy[start:end, None])).mul_(
                -grad_entropy[start:end, None].float()
            )
        return grad_logits
