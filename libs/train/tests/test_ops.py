"""plait_train.ops.head_logprobs: the chunked output head equals the full logits, LoRA parts on
the projection included."""

from __future__ import annotations

import pytest
import torch

from plait_train import ops


@pytest.mark.parametrize("chunk_rows", [3, 4, 100])
def test_low_rank_parts_in_runs_equal_the_full_logits(
    chunk_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two adapters whose positions are interleaved runs (as the datums of a shared pass are),
    cut by chunk edges, and positions of the base alone: logprobs, entropies and the gradients
    of the hidden states and of both factors of each adapter are those of the full logits."""
    monkeypatch.setattr(ops, "_CHUNK_BYTES", 4 * 11 * chunk_rows)  # chunk_rows positions
    generator = torch.Generator().manual_seed(0)
    n, hidden_size, vocab, rank = 13, 6, 11, 2
    hidden = torch.randn(n, hidden_size, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=generator)
    targets = torch.randint(0, vocab, (n,), generator=generator)
    rows = [torch.tensor([0, 1, 2, 6, 7, 12]), torch.tensor([3, 4, 5, 9, 10])]  # 8, 11: base
    u = [torch.randn(len(r), rank, generator=generator, requires_grad=True) for r in rows]
    b = [torch.randn(vocab, rank, generator=generator, requires_grad=True) for _ in rows]

    logprobs, entropy = ops.head_logprobs(
        hidden, weight, targets, [(r, uk, bk) for r, uk, bk in zip(rows, u, b, strict=True)]
    )
    grad = torch.randn(n, generator=generator)
    got = torch.autograd.grad(logprobs, [hidden, *u, *b], grad)

    logits = hidden @ weight.T
    for r, uk, bk in zip(rows, u, b, strict=True):
        logits = logits.index_add(0, r, uk @ bk.T)
    full = torch.log_softmax(logits, -1)
    expected = full.gather(-1, targets[:, None]).squeeze(-1)
    want = torch.autograd.grad(expected, [hidden, *u, *b], grad)
    torch.testing.assert_close(logprobs, expected.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach(), atol=1e-5, rtol=1e-5)
    for have, expect in zip(got, want, strict=True):
        torch.testing.assert_close(have, expect, atol=1e-5, rtol=1e-5)
