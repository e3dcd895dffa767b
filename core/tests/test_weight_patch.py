"""The delta format of weight sync: diffs are exact overwrites, packing round-trips, checksums bite."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plait import weight_patch as wp
from plait.types import TensorPatch, WeightUpdate


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def roundtrip(update: WeightUpdate) -> WeightUpdate:
    header, pieces = wp.pack(update)
    buffer = wp.to_bytes(pieces)
    return wp.unpack(header, wp.from_bytes(buffer, wp.piece_specs(header)))


@given(numel=st.integers(1, 3000), changes=st.lists(st.integers(0, 2999), max_size=200),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_a_patch_turns_old_into_new_bit_for_bit(numel, changes, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    old = torch.randn(numel, generator=generator).to(dtype)
    new = old.clone()
    positions = torch.tensor(sorted({c % numel for c in changes}), dtype=torch.long)
    if positions.numel():
        new[positions] = torch.randn(positions.numel(), generator=generator).to(dtype)
    patch = wp.diff(old, new)
    target = old.clone()
    wp.apply(target, roundtrip(WeightUpdate(1, {"w": patch}, kind="delta")).tensors["w"])
    assert torch.equal(bits(target), bits(new))
    assert wp.patch_nbytes(patch) <= new.numel() * new.element_size()


def test_sparse_changes_cost_a_few_bytes_each_and_long_gaps_use_fillers():
    old = torch.zeros(1_000_000, dtype=torch.bfloat16)
    new = old.clone()
    new[torch.arange(0, 1_000_000, 97)] = 1.0  # 1% changed, gaps of 97: one byte each
    patch = wp.diff(old, new)
    assert patch.gaps.dtype == torch.uint8
    assert wp.patch_nbytes(patch) == 10_310 * 3
    sparse = old.clone()
    sparse[[3, 400_000, 999_999]] = 2.0  # three far-apart changes: wide gaps beat fillers
    far = wp.diff(old, sparse)
    assert far.gaps.dtype == torch.int32 and far.gaps.numel() == 3
    clustered = old.clone()
    clustered[torch.arange(0, 1_000, 2)] = 1.0
    clustered[2_000] = 1.0  # one gap of 1002 among 499 of 2: three uint8 fillers beat uint16 gaps
    patch = wp.diff(old, clustered)
    assert patch.gaps.dtype == torch.uint8 and patch.gaps.numel() == 501 + 3
    target = old.clone()
    wp.apply(target, patch)
    assert torch.equal(bits(target), bits(clustered))


def test_bits_not_values_decide_what_changed():
    old = torch.tensor([0.0, 1.0, float("nan")])
    new = torch.tensor([-0.0, 1.0, float("nan")])
    patch = wp.diff(old, new)
    assert wp.positions_of(patch).tolist() == [0]  # -0.0 differs from 0.0; equal NaNs do not


def test_dense_when_most_elements_change():
    old = torch.randn(1000)
    patch = wp.diff(old, old + 1)
    assert patch.dense and wp.patch_nbytes(patch) == 4000


def test_checksum_names_dtype_and_bits():
    a = torch.arange(6, dtype=torch.float32)
    assert wp.checksum([("a", a)]) == wp.checksum([("a", a.clone())])
    assert wp.checksum([("a", a)]) != wp.checksum([("b", a)])
    assert wp.checksum([("a", a)]) != wp.checksum([("a", a.to(torch.float64))])
    assert wp.checksum([("a", a)]) != wp.checksum([("a", a.reshape(2, 3))])
    flipped = a.clone()
    flipped.view(torch.int32)[5] ^= 1  # one bit of one element
    assert wp.checksum([("a", a)]) != wp.checksum([("a", flipped)])


def test_apply_update_checks_everything_before_writing_and_the_checksum_after():
    weights = {"a": torch.zeros(4), "b": torch.zeros(3, dtype=torch.bfloat16)}
    new_b = torch.tensor([0.0, 5.0, 0.0], dtype=torch.bfloat16)
    good = WeightUpdate(2, {"a": wp.diff(weights["a"], torch.ones(4)), "b": wp.diff(weights["b"], new_b)},
                        kind="delta", checksum=wp.checksum([("a", torch.ones(4)), ("b", new_b)]))
    bad_dtype = WeightUpdate(2, {"a": good.tensors["a"],
                                 "b": TensorPatch((3,), torch.tensor([5.0]), torch.tensor([1], dtype=torch.uint8))},
                             kind="delta")
    for update, problem in [(bad_dtype, "bfloat16"),
                            (WeightUpdate(2, {"zz": good.tensors["a"]}, kind="delta"), "unknown"),
                            (WeightUpdate(2, {"a": TensorPatch((5,), torch.ones(5))}, kind="delta"), "shape"),
                            (WeightUpdate(2, {"a": torch.ones(4)}, kind="delta"), "TensorPatch")]:
        with pytest.raises(ValueError, match=problem):
            wp.apply_update(weights, update)
        assert not weights["a"].any() and not weights["b"].float().any(), "a refused update wrote something"
    wp.apply_update(weights, good)
    assert weights["a"].tolist() == [1.0] * 4 and weights["b"].tolist() == [0.0, 5.0, 0.0]
    drifted = {"a": torch.zeros(4), "b": torch.tensor([0.0, 0.0, 1.0], dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="checksum"):
        wp.apply_update(drifted, good)  # patches apply, but the untouched element differs


def test_pack_keeps_full_updates_and_metadata():
    update = WeightUpdate(7, {"w": torch.arange(6.0).reshape(2, 3), "v": torch.ones(2, dtype=torch.bfloat16)},
                          checksum="blake2b:x")
    back = roundtrip(update)
    assert back.kind == "full" and back.version == 7 and back.checksum == "blake2b:x" and back.base_version is None
    assert torch.equal(back.tensors["w"], update.tensors["w"]) and back.tensors["v"].dtype == torch.bfloat16
    header, pieces = wp.pack(update)
    with pytest.raises(ValueError, match="bytes"):
        wp.from_bytes(wp.to_bytes(pieces)[:-8], wp.piece_specs(header))
    with pytest.raises(ValueError, match="format"):
        wp.unpack({**header, "format": "other"}, pieces)
