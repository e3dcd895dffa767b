"""plait_train.layout: padded, packed and prefix-shared rows (needs torch)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")

from plait_train.layout import (  # noqa: E402
    LayoutOptions,
    MicroBatch,
    attention_mask,
    plan_micro_batches,
    split_for_ranks,
)


@st.composite
def token_batches(draw: st.DrawFn) -> list[list[int]]:
    """Sequences over a tiny vocabulary, many of them continuing a prefix of an earlier one
    (GRPO groups, multi-turn histories, duplicates, one sequence a prefix of another)."""
    sequences: list[list[int]] = []
    for _ in range(draw(st.integers(1, 10))):
        if sequences and draw(st.booleans()):
            base = draw(st.sampled_from(sequences))
            cut = draw(st.integers(0, len(base)))
            tail = draw(st.lists(st.integers(0, 3), min_size=0 if cut else 1, max_size=6))
            sequences.append(base[:cut] + tail)
        else:
            sequences.append(draw(st.lists(st.integers(0, 3), min_size=1, max_size=10)))
    return sequences


def build(sequences: list[list[int]], options: LayoutOptions) -> list[MicroBatch]:
    tokens = [np.asarray(s, dtype=np.int64) for s in sequences]
    inputs = [
        {"target_tokens": np.arange(len(s), dtype=np.int64) + 100 * i}
        for i, s in enumerate(sequences)
    ]
    return [
        MicroBatch.build(rows, tokens, inputs, torch.device("cpu"))
        for rows in plan_micro_batches(tokens, options)
    ]


def attended(batch: MicroBatch) -> torch.Tensor:
    """(R, W, W) what each slot attends to, as the model will see it."""
    rows, width = batch.input_ids.shape
    if batch.reach is None:
        return torch.ones(width, width, dtype=torch.bool).tril().expand(rows, width, width)
    return attention_mask(batch.reach)[:, 0]


def trie_size(sequences: list[list[int]]) -> int:
    return len({tuple(s[: i + 1]) for s in sequences for i in range(len(s))})


@settings(max_examples=150, deadline=None)
@given(
    sequences=token_batches(),
    budget=st.integers(1, 48),
    packing=st.booleans(),
    sharing=st.booleans(),
)
def test_every_datum_sees_exactly_its_own_prefix(
    sequences: list[list[int]], budget: int, packing: bool, sharing: bool
) -> None:
    options = LayoutOptions(budget, packing=packing, prefix_sharing=sharing)
    batches = build(sequences, options)
    seen = sorted(i for b in batches for i in b.indices)
    assert seen == list(range(len(sequences))), "every datum exactly once"
    for batch in batches:
        rows, width = batch.input_ids.shape
        assert rows == 1 or rows * width <= budget, "several rows only within the token budget"
        flat_ids = batch.input_ids.reshape(-1)
        positions = (
            batch.position_ids
            if batch.position_ids is not None
            else torch.arange(width).expand(rows, width)
        ).reshape(-1)
        sees = attended(batch)
        for b, index in enumerate(batch.indices):
            n = batch.lengths[b]
            slots = batch.slots[b, :n]
            assert flat_ids[slots].tolist() == sequences[index]
            assert positions[slots].tolist() == list(range(n))
            assert (
                batch.inputs["target_tokens"][b, :n].tolist()
                == (np.arange(n) + 100 * index).tolist()
            )
            assert not batch.valid[b, n:].any()
            row = int(slots[0]) // width
            assert (slots // width == row).all(), "a datum lives in one row"
            for i in range(n):
                keys = set(torch.nonzero(sees[row, int(slots[i]) % width]).flatten().tolist())
                assert keys == {int(s) % width for s in slots[: i + 1]}, (
                    f"datum {index} position {i} attends {sorted(keys)}, "
                    f"not its own positions 0..{i}"
                )
        if not sharing:
            used = batch.slots[batch.valid]
            assert used.unique().numel() == used.numel(), (
                "without sharing no slot serves two datums"
            )
        if not (packing or sharing):
            assert rows == len(batch.indices) and batch.reach is None and batch.position_ids is None


@settings(max_examples=60, deadline=None)
@given(sequences=token_batches())
def test_sharing_computes_every_distinct_prefix_once(sequences: list[list[int]]) -> None:
    batches = build(sequences, LayoutOptions(10_000, packing=True, prefix_sharing=True))
    computed = sum(
        int(b.valid.sum()) - sum(b.lengths[i] - b.owned[i] for i in range(len(b.indices)))
        for b in batches
    )
    assert computed == trie_size(sequences)
    assert sum(sum(b.owned) for b in batches) == trie_size(sequences)


def grpo_batch(groups: int, samples: int, prompt: int, response: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    batch = []
    for _ in range(groups):
        head = rng.integers(0, 1000, prompt).tolist()
        batch += [head + rng.integers(0, 1000, response).tolist() for _ in range(samples)]
    return batch


def test_a_grpo_group_stays_in_one_row_and_computes_its_prompt_once() -> None:
    sequences = grpo_batch(groups=3, samples=4, prompt=10, response=3)
    batches = build(sequences, LayoutOptions(30, packing=True, prefix_sharing=True))
    groups_per_row: dict[tuple[int, int], set[int]] = {}
    for number, batch in enumerate(batches):
        width = batch.input_ids.shape[1]
        for b, index in enumerate(batch.indices):
            groups_per_row.setdefault((number, int(batch.slots[b, 0]) // width), set()).add(
                index // 4
            )
    assert all(len(groups) == 1 for groups in groups_per_row.values()), groups_per_row
    assert sum(b.computed_tokens for b in batches) == 3 * (10 + 4 * 3)


def test_a_group_too_large_for_a_row_is_split_between_samples() -> None:
    # 8 samples of prompt 10 + response 5: 50 shared tokens; a budget of 30 splits the group
    # into two trees of 4 samples, each computing the prompt once.
    sequences = grpo_batch(groups=1, samples=8, prompt=10, response=5)
    batches = build(sequences, LayoutOptions(30, packing=True, prefix_sharing=True))
    assert sorted(b.computed_tokens for b in batches) == [30, 30]
    assert sum(sum(b.owned) for b in batches) == 2 * 10 + 8 * 5


def test_packing_fills_rows_as_wide_as_the_longest_sequence() -> None:
    lengths = [40, 30, 10, 10, 8, 2]
    sequences = [list(range(1, n + 1)) for n in lengths]
    packed = build(sequences, LayoutOptions(1000, packing=True))
    assert [tuple(b.input_ids.shape) for b in packed] == [(3, 40)]  # 40 | 30+10 | 10+8+2
    padded = build(sequences, LayoutOptions(1000))
    assert [tuple(b.input_ids.shape) for b in padded] == [(6, 40)]


@settings(max_examples=60, deadline=None)
@given(sequences=token_batches(), ranks=st.integers(1, 4), sharing=st.booleans())
def test_split_for_ranks_gives_every_datum_to_one_rank(
    sequences: list[list[int]], ranks: int, sharing: bool
) -> None:
    tokens = [np.asarray(s, dtype=np.int64) for s in sequences]
    shares = split_for_ranks(tokens, LayoutOptions(64, prefix_sharing=sharing), ranks)
    assert len(shares) == ranks
    assert sorted(i for share in shares for i in share) == list(range(len(sequences)))


def test_split_for_ranks_keeps_groups_together_and_balances_them() -> None:
    # Every sample starts with the same "system prompt" token; groups share 10 more tokens.
    sequences = [[7, *s] for s in grpo_batch(groups=4, samples=4, prompt=10, response=3)]
    tokens = [np.asarray(s, dtype=np.int64) for s in sequences]
    shares = split_for_ranks(tokens, LayoutOptions(64, prefix_sharing=True), 2)
    assert [len(share) for share in shares] == [8, 8]
    for share in shares:
        assert all(i // 4 * 4 + k in share for i in share for k in range(4)), "a group on one rank"
