"""A call's data as micro-batches of rows, each micro-batch one forward pass of the model.

Three layouts share one representation:

- padded: one datum per row, rows right-padded to the longest row of their micro-batch;
- packed: several datums per row, each with its own position ids and no attention across them,
  rows as wide as the longest sequence (so attention costs no more than padding would);
- prefix-shared: datums that start with the same tokens (the samples of a GRPO group share their
  prompt, the turns of a conversation its history) share the slots of that prefix, so the prefix
  is computed once, forward and backward, and receives the gradients of every branch.

A row holds a token tree in depth-first order (a packed row is a forest of chains). Slot k
*reaches* up to `reach[k]`, the end of the subtree k belongs to: slot q attends to slot k iff
k <= q < reach[k]. That one rule gives causal attention along every root-to-leaf path and none
across branches or sequences; a padding slot reaches only itself. Rows holding a single chain need
no mask at all (causal attention, right padding), which is the padded layout.

Every datum maps its positions onto slots: `slots[b, i]` is the flat index (row * width + column)
of the slot whose hidden state serves position i of the micro-batch's b-th datum. The output head
and the loss read hidden states through it; each datum keeps its own targets and loss inputs, also
at shared positions.

Planning works on numpy token arrays (`plan_micro_batches`); `MicroBatch.build` makes tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import torch

# Loss inputs that hold token ids; every other loss input is a float tensor.
INT_INPUTS = frozenset({"target_tokens"})


@attrs.frozen
class LayoutOptions:
    micro_batch_tokens: int
    """Rows x width per forward pass (a single longer row gets a pass of its own)."""
    packing: bool = False
    """Put several sequences (or trees) in one row."""
    prefix_sharing: bool = False
    """Compute positions that several datums share (same tokens from the start) once."""


@attrs.define
class RowPlan:
    """One row: its tokens in slot order, and where each member datum's positions are."""

    members: list[int]
    tokens: np.ndarray
    positions: np.ndarray
    reach: np.ndarray
    slots: list[np.ndarray]
    """Per member: the slot of each of its positions."""
    owned: list[int]
    """Per member: how many slots it added (its positions not shared with an earlier member)."""

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def single_chain(self) -> bool:
        return len(self.members) == 1


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def build_row(sequences: Sequence[np.ndarray], members: Sequence[int], *, share: bool) -> RowPlan:
    """Lay out `members` (indices into `sequences`) in one row, as a prefix tree when `share`."""
    order = sorted(members, key=lambda i: sequences[i].tolist()) if share else list(members)
    shared = [0] + [
        common_prefix(sequences[a], sequences[b]) if share else 0
        for a, b in itertools.pairwise(order)
    ]
    size = sum(len(sequences[i]) - s for i, s in zip(order, shared, strict=True))
    tokens = np.empty(size, dtype=np.int64)
    positions = np.empty(size, dtype=np.int64)
    reach = np.empty(size, dtype=np.int64)
    slots: dict[int, np.ndarray] = {}
    owned: dict[int, int] = {}
    # The path of the last datum, as [depth_start, depth_end, slot_start] nodes. Sorted order
    # guarantees that a node left behind never gains another descendant: its reach is final.
    path: list[list[int]] = []
    cursor = 0
    for index, common in zip(order, shared, strict=True):
        seq = sequences[index]
        while path and path[-1][0] >= common:
            start, end, slot = path.pop()
            reach[slot : slot + end - start] = cursor
        if path and path[-1][1] > common:  # the new datum branches off inside this node: split it
            start, end, slot = path[-1]
            reach[slot + common - start : slot + end - start] = cursor
            path[-1][1] = common
        added = len(seq) - common
        if added:
            tokens[cursor : cursor + added] = seq[common:]
            positions[cursor : cursor + added] = np.arange(common, len(seq))
            path.append([common, len(seq), cursor])
            cursor += added
        slots[index] = np.concatenate(
            [np.arange(slot, slot + end - start) for start, end, slot in path]
        )
        owned[index] = added
    for start, end, slot in path:
        reach[slot : slot + end - start] = cursor
    members = list(members)
    return RowPlan(
        members, tokens, positions, reach, [slots[i] for i in members], [owned[i] for i in members]
    )


def _units(sequences: Sequence[np.ndarray], share: bool) -> list[tuple[list[int], list[int]]]:
    """Datums that must share a row to share a prefix: (members in sorted order, prefix each
    shares with its predecessor). Without sharing, every datum is a unit of its own."""
    if not share:
        return [([i], [0]) for i in range(len(sequences))]
    order = sorted(range(len(sequences)), key=lambda i: sequences[i].tolist())
    units: list[tuple[list[int], list[int]]] = []
    previous = None
    for index in order:
        common = common_prefix(sequences[previous], sequences[index]) if previous is not None else 0
        if common and units:
            units[-1][0].append(index)
            units[-1][1].append(common)
        else:
            units.append(([index], [0]))
        previous = index
    return units


def _unit_size(sequences: Sequence[np.ndarray], members: list[int], shared: list[int]) -> int:
    return sum(len(sequences[i]) for i in members) - sum(shared[1:])


def _split(
    sequences: Sequence[np.ndarray], members: list[int], shared: list[int], capacity: int
) -> list[tuple[list[int], list[int]]]:
    """Cut a unit that does not fit a row at its weakest link (the smallest shared prefix, nearest
    the middle), so that the datums that share the most stay together."""
    if len(members) == 1 or _unit_size(sequences, members, shared) <= capacity:
        return [(members, shared)]
    cut = min(range(1, len(members)), key=lambda i: (shared[i], abs(2 * i - len(members))))
    return _split(sequences, members[:cut], shared[:cut], capacity) + _split(
        sequences, members[cut:], [0, *shared[cut + 1 :]], capacity
    )


def plan_rows(sequences: Sequence[np.ndarray], options: LayoutOptions) -> list[RowPlan]:
    """The rows that hold `sequences` (each datum's input tokens) under `options`."""
    share = options.prefix_sharing
    units = _units(sequences, share)
    sizes = [_unit_size(sequences, m, s) for m, s in units]
    longest = max(len(s) for s in sequences)
    # Rows as wide as the widest tree that fits the budget, and never narrower than the longest
    # sequence: packing then never widens attention beyond what padding would have cost.
    capacity = max(longest, min(options.micro_batch_tokens, max(sizes)))
    chunks = [
        chunk for members, shared in units for chunk in _split(sequences, members, shared, capacity)
    ]
    if not options.packing:
        groups = [members for members, _ in chunks]
    else:  # first fit decreasing
        groups = []
        free: list[int] = []  # the room left in each row
        for members, shared in sorted(chunks, key=lambda c: -_unit_size(sequences, *c)):
            size = _unit_size(sequences, members, shared)
            row = next((r for r, room in enumerate(free) if room >= size), None)
            if row is None:
                groups.append([])
                free.append(capacity)
                row = len(groups) - 1
            groups[row].extend(members)
            free[row] -= size
    return [build_row(sequences, g, share=share) for g in groups]


def split_for_ranks(
    sequences: Sequence[np.ndarray], options: LayoutOptions, ranks: int
) -> list[list[int]]:
    """Datum indices for each of `ranks` data-parallel processes: datums that share a prefix stay
    together (when sharing), and every process gets about as many tokens to compute."""
    units = _units(sequences, options.prefix_sharing)
    total = sum(_unit_size(sequences, *u) for u in units)
    # A unit much larger than a fair share (everything starts with the same system prompt) is cut
    # at its weakest links, like a unit too large for a row.
    fair = max(max(len(s) for s in sequences), -(-total // ranks))
    chunks = [
        chunk for members, shared in units for chunk in _split(sequences, members, shared, fair)
    ]
    loads = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for members, shared in sorted(chunks, key=lambda c: -_unit_size(sequences, *c)):
        rank = loads.index(min(loads))
        shares[rank].extend(members)
        loads[rank] += _unit_size(sequences, members, shared)
    return [sorted(share) for share in shares]


def plan_micro_batches(
    sequences: Sequence[np.ndarray], options: LayoutOptions
) -> list[list[RowPlan]]:
    """Rows grouped into micro-batches of at most `micro_batch_tokens` rows x width, widest first
    (so that rows of similar width share a micro-batch and little padding is added)."""
    rows = sorted(plan_rows(sequences, options), key=lambda r: -r.size)
    batches: list[list[RowPlan]] = []
    for row in rows:
        if batches and (len(batches[-1]) + 1) * batches[-1][0].size <= options.micro_batch_tokens:
            batches[-1].append(row)
        else:
            batches.append([row])
    return batches


def attention_mask(reach: torch.Tensor) -> torch.Tensor:
    """(R, 1, W, W) boolean mask, True where query q may attend to key k: k <= q < reach[k]."""
    width = reach.shape[-1]
    column = torch.arange(width, device=reach.device)
    causal = column[None, :] <= column[:, None]
    return (causal[None] & (column[None, :, None] < reach[:, None, :]))[:, None]


@attrs.frozen
class MicroBatch:
    """One forward pass: rows of tokens, and each datum's positions and loss inputs on them."""

    indices: list[int]
    """The datums, as indices into the call's data."""
    input_ids: torch.Tensor
    """(R, W) token ids, 0 on padding."""
    position_ids: torch.Tensor | None
    """(R, W); None when every row holds one sequence from position 0."""
    reach: torch.Tensor | None
    """(R, W), see the module docstring; None when plain causal attention is right."""
    slots: torch.Tensor
    """(B, L) flat index into R x W of the slot serving each datum position (0 past its end)."""
    valid: torch.Tensor
    """(B, L) False past each datum's end."""
    inputs: dict[str, torch.Tensor]
    """(B, L) per loss input, 0 past each datum's end."""
    lengths: list[int]
    owned: list[int]
    """Per datum: the positions computed for it alone (the rest came from a shared prefix)."""
    routing: torch.Tensor | None = None
    """(R x W, layers, top_k) the sampler's experts of every slot (MoE routing data), None
    without."""
    routed: torch.Tensor | None = None
    """(R x W,) True on the slots `routing` covers (padding slots route to experts 0..top_k-1)."""

    @property
    def computed_tokens(self) -> int:
        """Positions the model runs, padding included."""
        return int(self.input_ids.numel())

    @classmethod
    def build(
        cls,
        rows: Sequence[RowPlan],
        tokens: Sequence[np.ndarray],
        inputs: Sequence[Mapping[str, np.ndarray]],
        device: torch.device,
        routing: Sequence[np.ndarray] | None = None,
    ) -> MicroBatch:
        """Tensors for `rows`; `tokens[i]` / `inputs[i]` are datum i's input ids and loss inputs,
        `routing[i]` its routed experts (positions, layers, top_k)."""
        width = max(r.size for r in rows)
        ids = np.zeros((len(rows), width), dtype=np.int64)
        chained = any(not r.single_chain for r in rows)
        position_ids = np.zeros((len(rows), width), dtype=np.int64)
        # Padding slots reach only themselves, so no query ever has an empty row of keys.
        reach = np.tile(np.arange(1, width + 1, dtype=np.int64), (len(rows), 1))
        members = [
            (row_index, m, slots, owned)
            for row_index, r in enumerate(rows)
            for m, slots, owned in zip(r.members, r.slots, r.owned, strict=True)
        ]
        length = max(len(tokens[m]) for _, m, _, _ in members)
        slot_index = np.zeros((len(members), length), dtype=np.int64)
        valid = np.zeros((len(members), length), dtype=bool)
        keys = list(inputs[members[0][1]])
        loss_inputs = {
            k: np.zeros((len(members), length), dtype=np.int64 if k in INT_INPUTS else np.float32)
            for k in keys
        }
        for row_index, r in enumerate(rows):
            ids[row_index, : r.size] = r.tokens
            position_ids[row_index, : r.size] = r.positions
            reach[row_index, : r.size] = r.reach
        for b, (row_index, m, slots, _) in enumerate(members):
            n = len(tokens[m])
            slot_index[b, :n] = row_index * width + slots
            valid[b, :n] = True
            for key in keys:
                loss_inputs[key][b, :n] = inputs[m][key]

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device)

        slot_routing = routed = None
        if routing is not None:
            layers, top_k = routing[members[0][1]].shape[1:]
            slot_routing = np.tile(np.arange(top_k, dtype=np.int64), (len(rows) * width, layers, 1))
            routed = np.zeros(len(rows) * width, dtype=bool)
            for b, (_, m, _, _) in enumerate(members):
                slot_routing[slot_index[b, : len(tokens[m])]] = routing[m]
                routed[slot_index[b, : len(tokens[m])]] = True

        return cls(
            indices=[m for _, m, _, _ in members],
            input_ids=tensor(ids),
            position_ids=tensor(position_ids) if chained else None,
            reach=tensor(reach) if chained else None,
            slots=tensor(slot_index),
            valid=tensor(valid),
            inputs={k: tensor(v) for k, v in loss_inputs.items()},
            lengths=[len(tokens[m]) for _, m, _, _ in members],
            owned=[owned for _, _, _, owned in members],
            routing=None if slot_routing is None else tensor(slot_routing),
            routed=None if routed is None else tensor(routed),
        )
