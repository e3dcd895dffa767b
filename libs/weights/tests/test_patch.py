"""The delta format of weight sync: diffs are exact (bit steps or overwrites), packing round-trips,
checksums bite, and step patches refuse a base other than their own."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from plait.api import WeightUpdate
from plait_weights.delta import TensorPatch, WeightBaseError

torch = pytest.importorskip("torch")  # the core imports without torch; its delta format needs it

from plait_weights import patch as wp  # noqa: E402


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def roundtrip(update: WeightUpdate) -> WeightUpdate:
    header, pieces = wp.pack(update)
    buffer = wp.to_bytes(pieces)
    return wp.unpack(header, wp.from_bytes(buffer, wp.piece_specs(header)))


@given(
    numel=st.integers(1, 3000),
    changes=st.lists(st.integers(0, 2999), max_size=200),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
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


INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def delta(
    version: int, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], **fields
) -> WeightUpdate:
    """The delta update turning `old` into `new`, as the sync's publisher makes it."""
    patches = {name: wp.diff(old[name], new[name]) for name in new}
    return WeightUpdate(
        version,
        patches,
        kind="delta",
        checksum=wp.checksum(new.items()),
        base_checksum=wp.base_checksum(old, patches),
        **fields,
    )


@given(
    numel=st.integers(1, 2000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
    stepped=st.integers(0, 300),
    jumps=st.integers(0, 3),
    largest_step=st.sampled_from([1, 127, 128, 40_000]),
)
@settings(max_examples=80, deadline=None)
def test_diff_and_apply_are_bit_exact_on_any_bit_patterns(
    numel, dtype, seed, stepped, jumps, largest_step
):
    """Arbitrary bit patterns (NaN payloads, infinities, -0.0, subnormals), small steps of them
    (a rounding boundary crossed) and arbitrary jumps (escaped values, or values throughout):
    always exact."""
    generator = torch.Generator().manual_seed(seed)
    int_dtype = INT_OF[dtype]
    info = torch.iinfo(int_dtype)
    old_bits = torch.randint(info.min, info.max, (numel,), generator=generator, dtype=torch.int64)
    old_bits[: min(numel, 4)] = torch.tensor(
        [0, info.min, 0x7F80 if dtype == torch.bfloat16 else -1, 1]
    )[: min(numel, 4)]
    new_bits = old_bits.clone()
    where = torch.randint(0, numel, (stepped,), generator=generator)
    new_bits[where] += torch.randint(
        -largest_step, largest_step + 1, (stepped,), generator=generator
    )
    new_bits[torch.randint(0, numel, (jumps,), generator=generator)] = torch.randint(
        info.min, info.max, (jumps,), generator=generator
    )
    new_bits = new_bits.clamp(info.min, info.max)
    old, new = (b.to(int_dtype).view(dtype).reshape(-1, 1) for b in (old_bits, new_bits))
    update = roundtrip(delta(3, {"w": old}, {"w": new}, base_version=2))
    patch = update.tensors["w"]
    target = {"w": old.clone()}
    wp.apply_update(target, update, held_version=2)
    assert torch.equal(bits(target["w"]), bits(new))
    assert wp.patch_nbytes(patch) <= new.numel() * new.element_size()
    steps = new_bits - old_bits
    if jumps == 0 and not patch.dense and steps.abs().max() <= 127 and steps.any():
        assert patch.bit_steps and patch.values.dtype == torch.int8 and patch.escaped.numel() == 0


def test_a_bfloat16_rounding_step_costs_two_bytes_and_a_jump_is_escaped():
    old = torch.randn(100_000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    new = old.clone()
    changed = torch.arange(0, 100_000, 50)  # 2%, gaps of 50: one byte each
    new.view(torch.int16)[changed] += (
        1  # one unit in the last place: the element crossed one rounding boundary
    )
    patch = wp.diff(old, new)
    assert patch.bit_steps and patch.values.dtype == torch.int8 and patch.gaps.dtype == torch.uint8
    assert wp.patch_nbytes(patch) == 2_000 * 2  # a one-byte gap and a one-byte step per change
    new[7] = 1e30  # a jump wider than an int8 step: escaped, its value sent as well
    new[9] = -new[9]  # a sign change: the bit pattern jumps by 2**15
    patch = wp.diff(old, new)
    assert patch.bit_steps and torch.equal(bits(patch.escaped), bits(new[[7, 9]]))
    assert patch.values[:4].tolist() == [1, -128, -128, 1]  # positions 0, 7, 9, 50
    assert wp.patch_nbytes(patch) == 2_002 * 2 + 2 * 2
    target = old.clone()
    wp.apply(target, patch)
    assert torch.equal(bits(target), bits(new))
    new.view(torch.int16)[changed] += 1000  # most steps too wide: new values are cheaper
    patch = wp.diff(old, new)
    assert (
        not patch.bit_steps
        and patch.values.dtype == torch.bfloat16
        and wp.patch_nbytes(patch) == 2_002 * 3
    )
    float32 = torch.randn(1_000)
    moved = float32.clone()
    moved.view(torch.int32)[::10] += 300  # float32 steps of a few hundred units: int16
    patch = wp.diff(float32, moved)
    assert (
        patch.bit_steps and patch.values.dtype == torch.int16 and wp.patch_nbytes(patch) == 100 * 3
    )


def test_a_step_patch_refuses_another_base_before_writing():
    base = {"w": torch.randn(1_000).to(torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"].view(torch.int16)[::20] -= 1
    update = delta(5, base, new, base_version=4)
    assert update.tensors["w"].bit_steps
    other = {"w": base["w"].clone()}
    other["w"].view(torch.int16)[3] += 1  # one bit pattern off: another base
    kept = other["w"].clone()
    with pytest.raises(WeightBaseError, match="base checksum") as caught:
        wp.apply_update(other, update, held_version=4)
    assert "full weights" in caught.value.fix
    assert torch.equal(bits(other["w"]), bits(kept)), "a refused update wrote something"
    with pytest.raises(WeightBaseError, match="holds version 3"):
        wp.apply_update({"w": base["w"].clone()}, update, held_version=3)
    with pytest.raises(ValueError, match="base_checksum"):
        wp.apply_update({"w": base["w"].clone()}, WeightUpdate(5, update.tensors, kind="delta"))
    target = {"w": base["w"].clone()}
    wp.apply_update(target, update, held_version=4)
    assert torch.equal(bits(target["w"]), bits(new["w"]))
    with pytest.raises(WeightBaseError, match="base checksum"):
        wp.apply_update(
            target, update, held_version=5
        )  # the same patch twice (a later bucket of version 5 may)
    assert torch.equal(bits(target["w"]), bits(new["w"]))


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
    good = WeightUpdate(
        2,
        {"a": wp.diff(weights["a"], torch.ones(4)), "b": wp.diff(weights["b"], new_b)},
        kind="delta",
        checksum=wp.checksum([("a", torch.ones(4)), ("b", new_b)]),
    )
    bad_dtype = WeightUpdate(
        2,
        {
            "a": good.tensors["a"],
            "b": TensorPatch((3,), torch.tensor([5.0]), torch.tensor([1], dtype=torch.uint8)),
        },
        kind="delta",
    )
    for update, problem in [
        (bad_dtype, "bfloat16"),
        (WeightUpdate(2, {"zz": good.tensors["a"]}, kind="delta"), "unknown"),
        (WeightUpdate(2, {"a": TensorPatch((5,), torch.ones(5))}, kind="delta"), "shape"),
        (WeightUpdate(2, {"a": torch.ones(4)}, kind="delta"), "TensorPatch"),
    ]:
        with pytest.raises(ValueError, match=problem):
            wp.apply_update(weights, update)
        assert not weights["a"].any() and not weights["b"].float().any(), (
            "a refused update wrote something"
        )
    wp.apply_update(weights, good)
    assert weights["a"].tolist() == [1.0] * 4 and weights["b"].tolist() == [0.0, 5.0, 0.0]
    drifted = {"a": torch.zeros(4), "b": torch.tensor([0.0, 0.0, 1.0], dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="checksum"):
        wp.apply_update(drifted, good)  # patches apply, but the untouched element differs


def test_pack_keeps_full_updates_and_metadata():
    update = WeightUpdate(
        7,
        {"w": torch.arange(6.0).reshape(2, 3), "v": torch.ones(2, dtype=torch.bfloat16)},
        checksum="blake2b:x",
    )
    back = roundtrip(update)
    assert (
        back.kind == "full"
        and back.version == 7
        and back.checksum == "blake2b:x"
        and back.base_version is None
    )
    assert (
        torch.equal(back.tensors["w"], update.tensors["w"])
        and back.tensors["v"].dtype == torch.bfloat16
    )
    header, pieces = wp.pack(update)
    with pytest.raises(ValueError, match="bytes"):
        wp.from_bytes(wp.to_bytes(pieces)[:-8], wp.piece_specs(header))
    with pytest.raises(ValueError, match="format"):
        wp.unpack({**header, "format": "other"}, pieces)
