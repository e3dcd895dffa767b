"""plait_train.ops: the chunked output head equals the full logits, LoRA parts on the projection
included, and both paths' entropies have the gradient of autograd through log_softmax."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
    grad, grad_entropy = torch.randn(2, n, generator=generator)

    logits = hidden @ weight.T
    for r, uk, bk in zip(rows, u, b, strict=True):
        logits = logits.index_add(0, r, uk @ bk.T)
    full = torch.log_softmax(logits, -1)
    expected = full.gather(-1, targets[:, None]).squeeze(-1)
    expected_entropy = -(full.exp() * full).sum(-1)
    torch.testing.assert_close(logprobs, expected.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy.detach(), atol=1e-5, rtol=1e-5)
    # The logprobs' gradient alone, the entropy's alone (an entropy bonus), and both.
    for outputs, want_outputs, grads in [
        ([logprobs], [expected], [grad]),
        ([entropy], [expected_entropy], [grad_entropy]),
        ([logprobs, entropy], [expected, expected_entropy], [grad, grad_entropy]),
    ]:
        got = torch.autograd.grad(outputs, [hidden, *u, *b], grads, retain_graph=True)
        want = torch.autograd.grad(want_outputs, [hidden, *u, *b], grads, retain_graph=True)
        for have, expect in zip(got, want, strict=True):
            torch.testing.assert_close(have, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_entropy_gradient_is_that_of_log_softmax(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The full-logits path's entropy, chunked (3 rows at a time) in its backward pass too."""
    monkeypatch.setattr(ops, "_CHUNK_BYTES", 4 * 11 * 3)
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(7, 11, generator=generator)).to(dtype).requires_grad_()
    grad = torch.randn(7, generator=generator)
    entropy = ops.token_entropy(logits)
    logp = torch.log_softmax(logits.float(), -1)
    expected = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(entropy, expected.detach(), atol=1e-5, rtol=1e-5)
    (got,) = torch.autograd.grad(entropy, logits, grad)
    (want,) = torch.autograd.grad(expected, logits, grad)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class _VocabularyOps(TorchDispatchMode):
    """The aten operations run while active that make (positions x vocabulary) tensors: the
    work of an output head's backward pass."""

    def __init__(self, shape: tuple[int, int]) -> None:
        super().__init__()
        self.shape = torch.Size(shape)
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.shape == self.shape:
            self.names.append(func.overloadpacket.__name__)
        return out


def backward_ops(loss: torch.Tensor, inputs: torch.Tensor) -> list[str]:
    with _VocabularyOps((5, 11)) as ops_run:
        torch.autograd.grad(loss, inputs)
    return ops_run.names


def test_an_unused_entropy_adds_nothing_to_the_backward_pass() -> None:
    """Without an entropy bonus, the backward pass does the work of the logprobs alone: the
    chunked head skips the entropy's terms, the full-logits entropy never runs backward."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 6, generator=generator, requires_grad=True)
    weight = torch.randn(11, 6, generator=generator)
    targets = torch.randint(0, 11, (5,), generator=generator)

    logprobs, entropy = ops.head_logprobs(hidden, weight, targets)
    # the logits, - lse, exp, * -g, + g at the targets
    assert backward_ops(logprobs.sum(), hidden) == ["mm", "sub_", "exp_", "mul_", "index_put_"]
    logprobs, entropy = ops.head_logprobs(hidden, weight, targets)
    assert len(backward_ops(logprobs.sum() + entropy.sum(), hidden)) > 5

    logits = (hidden @ weight.T).detach().requires_grad_()
    alone = backward_ops(ops.target_logprobs(logits, targets).sum(), logits)
    assert ops.token_entropy(logits).requires_grad
    assert backward_ops(ops.target_logprobs(logits, targets).sum(), logits) == alone
