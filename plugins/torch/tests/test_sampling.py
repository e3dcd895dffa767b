"""Token choice with per-row temperature / top-k / top-p (pure tensor code, no model)."""

from __future__ import annotations

import torch

from plait_torch.inference import derive_seed
from plait_torch.sampling import RowParams, choose_tokens

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
GRID = 600  # evenly spaced uniforms: inverse-CDF sampling then hits each token p * GRID times


def params(rows: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> RowParams:
    return RowParams(
        torch.full((rows,), temperature),
        torch.full((rows,), top_k, dtype=torch.long),
        torch.full((rows,), top_p),
    )


def grid_choice(
    temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    uniforms = (torch.arange(GRID) + 0.5) / GRID
    return choose_tokens(LOGITS.expand(GRID, -1), params(GRID, temperature, top_k, top_p), uniforms)


def test_frequencies_follow_the_tempered_distribution() -> None:
    for temperature in (1.0, 0.5, 2.0):
        tokens, _ = grid_choice(temperature)
        counts = torch.bincount(tokens, minlength=len(LOGITS)).float()
        expected = torch.softmax(LOGITS / temperature, -1) * GRID
        assert torch.all((counts - expected).abs() <= 1.0), (temperature, counts, expected)


def test_logprobs_are_raw_whatever_the_sampling_parameters() -> None:
    raw = torch.log_softmax(LOGITS, -1)
    for kwargs in ({"temperature": 0.3}, {"top_k": 2}, {"top_p": 0.5}, {"temperature": 0.0}):
        tokens, logprobs = grid_choice(**kwargs)
        assert torch.allclose(logprobs, raw[tokens]), kwargs


def test_greedy_takes_the_argmax() -> None:
    tokens, _ = grid_choice(temperature=0.0)
    assert set(tokens.tolist()) == {0}


def test_top_k_keeps_the_k_best() -> None:
    tokens, _ = grid_choice(top_k=3)
    assert set(tokens.tolist()) == {0, 1, 2}
    counts = torch.bincount(tokens, minlength=len(LOGITS)).float()
    expected = torch.softmax(LOGITS[:3], -1) * GRID
    assert torch.all((counts[:3] - expected).abs() <= 1.0)


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.softmax(LOGITS, -1)  # 0.53, 0.20, 0.12, 0.07, ...
    tokens, _ = grid_choice(top_p=0.7)
    assert set(tokens.tolist()) == {0, 1}, (
        "the smallest set with mass >= 0.7 is the two best tokens"
    )
    tokens, _ = grid_choice(top_p=float(probs[0]) - 0.01)
    assert set(tokens.tolist()) == {0}


def test_rows_do_not_influence_each_other() -> None:
    """The same logits and uniform give the same token whatever the rest of the batch is."""
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 3])
    mixed = RowParams(
        torch.tensor([1.0, 0.0, 0.7]), torch.tensor([0, 0, 2]), torch.tensor([1.0, 1.0, 0.9])
    )
    uniforms = torch.tensor([0.61, 0.2, 0.99])
    together, lp_together = choose_tokens(rows, mixed, uniforms)
    for i in range(3):
        single = RowParams(
            mixed.temperature[i : i + 1], mixed.top_k[i : i + 1], mixed.top_p[i : i + 1]
        )
        alone, lp_alone = choose_tokens(rows[i : i + 1], single, uniforms[i : i + 1])
        assert alone.item() == together[i].item() and lp_alone.item() == lp_together[i].item()


def test_zero_probability_tokens_are_never_chosen() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]]).expand(GRID, -1)
    uniforms = (torch.arange(GRID) + 0.5) / GRID
    tokens, _ = choose_tokens(logits, params(GRID), uniforms)
    assert set(tokens.tolist()) == {0, 2}
    edge, _ = choose_tokens(logits[:1], params(1), torch.tensor([1.0 - 1e-9]))
    assert edge.item() == 2


def test_sample_seeds_are_deterministic_and_distinct() -> None:
    assert derive_seed(5, 0) == derive_seed(5, 0)
    seeds = {derive_seed(s, i) for s in range(4) for i in range(8)}
    assert len(seeds) == 32 and all(0 <= s < 2**63 for s in seeds)
