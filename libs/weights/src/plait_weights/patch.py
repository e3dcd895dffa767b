"""The delta format of weight sync: diff two versions of a tensor, apply the patch, check bits.

A `TensorPatch` (`plait_weights.delta`) lists the elements of one tensor that changed, as
gap-encoded flat positions and, per position, what turns the old element into the new one bit for
bit (no float drift, unlike sending additive float deltas). Why this pays: an engine serving
bfloat16 weights only sees a change where a trainer's float32 master weight crosses a bfloat16
rounding boundary, which at RL learning rates is a few percent of elements per step or less
(PULSE, arXiv 2602.03839), and such an element moves by one unit in the last place. In float32
nearly every element changes after an Adam step, and the patch falls back to a dense entry
(never larger than the tensor itself).

Encoding (what `TensorPatch` holds and the wire carries):

- positions ascend; `gaps[0]` is the first position and `gaps[i]` the distance to the previous
  one. The narrowest of uint8 / uint16 / int32 that minimises the patch's bytes is chosen; a gap
  too long for it is split by *filler* entries, which leave an unchanged element as it is.
- per position, a *bit step* when a signed integer dtype narrower than the tensor's (int8 /
  int16 / int32) makes the patch smaller: new bits = old bits + step, computed on the raw bit
  patterns as integers (so NaN payloads, -0.0 and infinities are exact). A bfloat16 element that
  crosses one rounding boundary steps by +-1: one byte instead of two. A step the dtype cannot
  hold (a sign change near zero, a jump) is written as the escape code, the dtype's minimum, and
  its new value follows in `escaped`. Steps need exactly the base they were made against, so an
  update with step patches carries the base's `base_checksum`, and `apply_update` refuses,
  before writing, weights that differ from it. Otherwise (many jumps, 1-byte dtypes) the new
  values, in the tensor's dtype, overwrite the old ones, on any base of the right shape.
- an entry is dense (`gaps=None`, the whole tensor's values) when that is smaller.

`checksum` fingerprints tensors by name, dtype, shape and bytes (BLAKE2b), so a receiver can
prove that it holds bit for bit what the trainer sent. `pack` / `unpack` turn an update into a
JSON header plus flat tensors for a transport (disk, torch.distributed).

Imports torch: load it only where weights move.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from plait.api import WeightUpdate
from plait_weights.delta import TensorPatch, WeightBaseError

FORMAT = "plait-weights/2"

# (dtype, largest gap it holds): the candidate encodings of positions, narrowest first.
_GAP_DTYPES = ((torch.uint8, 255), (torch.uint16, 65_535), (torch.int32, 2**31 - 1))
_STEP_DTYPES = (
    torch.int8,
    torch.int16,
    torch.int32,
)  # candidate encodings of bit steps, narrowest first
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r}")
    return dtype


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bit patterns as integers (so -0.0 != 0.0 and NaNs compare by payload)."""
    return tensor.reshape(-1).view(_BITS[tensor.element_size()])


def diff(old: torch.Tensor, new: torch.Tensor) -> TensorPatch:
    """The patch that turns `old` into `new` bit for bit (same shape, dtype and device)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(
            f"cannot diff a {old.dtype} {tuple(old.shape)} tensor against a "
            f"{new.dtype} {tuple(new.shape)} one"
        )
    flat = new.reshape(-1)
    old_bits, new_bits = _bits(old), _bits(new)
    positions = (old_bits != new_bits).nonzero().squeeze(1)
    if positions.numel() == 0:
        return TensorPatch(new.shape, flat[:0].clone(), torch.empty(0, dtype=torch.uint8))
    value_size = new.element_size()
    step_dtype, escapes = _step_encoding(
        new_bits[positions].to(torch.int64) - old_bits[positions].to(torch.int64), value_size
    )
    entry_size = value_size if step_dtype is None else step_dtype.itemsize
    gaps, positions = _encode_positions(positions, entry_size)
    if (
        gaps.numel() * (gaps.element_size() + entry_size) + escapes * value_size
        >= flat.numel() * value_size
    ):
        return TensorPatch(new.shape, flat.clone())
    positions = positions.to(flat.device)
    if step_dtype is None:
        return TensorPatch(new.shape, flat[positions], gaps.cpu())
    steps = new_bits[positions].to(torch.int64) - old_bits[positions].to(
        torch.int64
    )  # 0 at fillers
    escape = _escaped(steps, step_dtype)
    return TensorPatch(
        new.shape,
        steps.masked_fill(escape, torch.iinfo(step_dtype).min).to(step_dtype),
        gaps.cpu(),
        escaped=flat[positions][escape],
    )


def _escaped(steps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Which steps `dtype` cannot hold (its minimum is the escape code, so it holds none of it)."""
    info = torch.iinfo(dtype)
    return (steps <= info.min) | (steps > info.max)


def _step_encoding(steps: torch.Tensor, value_size: int) -> tuple[torch.dtype | None, int]:
    """(the step dtype narrower than the value that minimises the bytes of steps plus escaped
    values, or None when values alone are cheapest; the number of escaped elements)."""
    best: tuple[int, torch.dtype | None, int] = (steps.numel() * value_size, None, 0)
    for dtype in _STEP_DTYPES:
        if dtype.itemsize >= value_size:
            break
        escapes = int(_escaped(steps, dtype).sum())
        size = steps.numel() * dtype.itemsize + escapes * value_size
        if size < best[0]:
            best = (size, dtype, escapes)
    return best[1], best[2]


def _encode_positions(
    positions: torch.Tensor, value_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gaps in the cheapest dtype, the positions they encode, fillers included)."""
    positions = positions.to(torch.int64)
    gaps = torch.diff(positions, prepend=positions.new_zeros(1))
    best: tuple[int, torch.dtype, int, torch.Tensor] | None = None
    for dtype, limit in _GAP_DTYPES:
        pieces = ((gaps + limit - 1) // limit).clamp(min=1)  # entries per gap, fillers included
        count = int(pieces.sum())
        size = count * (dtype.itemsize + value_size)
        if best is None or size < best[0]:
            best = (size, dtype, limit, pieces)
    assert best is not None  # _GAP_DTYPES is not empty
    _, dtype, limit, pieces = best
    if int(pieces.max()) == 1:
        return gaps.to(dtype), positions
    # Split long gaps: k pieces of one gap are k-1 steps of `limit` and the remainder.
    split = torch.full((int(pieces.sum()),), limit, dtype=torch.int64, device=gaps.device)
    ends = pieces.cumsum(0) - 1
    split[ends] = gaps - (pieces - 1) * limit
    return split.to(dtype), split.cumsum(0)


def positions_of(patch: TensorPatch) -> torch.Tensor:
    """The flat positions a sparse patch writes (int64)."""
    if patch.gaps is None:
        raise ValueError("a dense patch writes the whole tensor: it has no positions")
    return patch.gaps.to(torch.int64).cumsum(0)


def apply(target: torch.Tensor, patch: TensorPatch) -> None:
    """Write the patched elements of `target` in place. Raises ValueError (changing nothing) when
    the patch does not fit the tensor. A `bit_steps` patch gives the new weights only on the
    exact base it was made against: `apply_update` checks that, this does not."""
    problem = _misfit(target, patch)
    if problem:
        raise ValueError(problem)
    values = torch.as_tensor(patch.values)
    flat = target.view(-1)
    if patch.dense:
        flat.copy_(values.reshape(-1))
        return
    positions = positions_of(patch).to(flat.device)
    if patch.bit_steps:
        bits = flat.view(_BITS[target.element_size()])
        steps = values.to(flat.device, torch.int64)
        written = (bits[positions].to(torch.int64) + steps).to(bits.dtype)
        escaped = torch.as_tensor(patch.escaped).to(flat.device).reshape(-1)
        written[steps == torch.iinfo(values.dtype).min] = escaped.view(bits.dtype)
        bits[positions] = written
    else:
        flat[positions] = values.to(flat.device)


def _misfit(target: torch.Tensor, patch: TensorPatch) -> str | None:
    """Why `patch` cannot apply to `target`, or None."""
    if tuple(patch.shape) != tuple(target.shape):
        return (
            f"patch for shape {tuple(patch.shape)} "
            f"does not fit a tensor of shape {tuple(target.shape)}"
        )
    values = torch.as_tensor(patch.values)
    if patch.dense:
        if patch.bit_steps:
            return "a dense patch holds values, not bit steps"
        if values.numel() != target.numel():
            return f"dense patch has {values.numel()} values for {target.numel()} elements"
        return None
    if patch.bit_steps:
        if values.dtype not in _STEP_DTYPES or values.element_size() >= target.element_size():
            return (
                f"bit steps are {dtype_name(values.dtype)}, not a signed integer dtype narrower "
                f"than the tensor's {dtype_name(target.dtype)}"
            )
        escaped = torch.as_tensor(patch.escaped)
        if escaped.dtype != target.dtype:
            return (
                f"escaped values are {dtype_name(escaped.dtype)} "
                f"but the tensor is {dtype_name(target.dtype)}"
            )
        escapes = int((values == torch.iinfo(values.dtype).min).sum())
        if escaped.numel() != escapes:
            return f"patch has {escapes} escaped steps but {escaped.numel()} escaped values"
    elif values.dtype != target.dtype:
        return (
            f"patch values are {dtype_name(values.dtype)} "
            f"but the tensor is {dtype_name(target.dtype)}; "
            "a sparse patch must be made in the receiver's dtype"
        )
    positions = positions_of(patch)
    if positions.numel() != values.numel():
        return f"patch has {positions.numel()} positions but {values.numel()} values"
    if positions.numel() and int(positions[-1]) >= target.numel():
        return (
            f"patch writes position {int(positions[-1])} of a tensor with {target.numel()} elements"
        )
    return None


def patch_elements(patch: TensorPatch) -> int:
    return int(torch.as_tensor(patch.values).numel())


def patch_nbytes(patch: TensorPatch) -> int:
    values = torch.as_tensor(patch.values)
    gaps = 0 if patch.gaps is None else patch.gaps.numel() * patch.gaps.element_size()
    escaped = 0 if patch.escaped is None else patch.escaped.numel() * patch.escaped.element_size()
    return values.numel() * values.element_size() + gaps + escaped


def update_nbytes(update: WeightUpdate) -> int:
    """Bytes of tensor data an update carries."""
    if update.kind == "delta":
        return sum(patch_nbytes(p) for p in update.tensors.values())
    return sum(
        int(torch.as_tensor(t).numel() * torch.as_tensor(t).element_size())
        for t in update.tensors.values()
    )


def checksum(tensors: Iterable[tuple[str, Any]]) -> str:
    """BLAKE2b over (name, dtype, shape, bytes) of each tensor, in name order."""
    digest = hashlib.blake2b(digest_size=16)
    for name, value in sorted(tensors, key=lambda item: item[0]):
        tensor = torch.as_tensor(value).detach()
        digest.update(f"{name}\0{dtype_name(tensor.dtype)}\0{tuple(tensor.shape)}\0".encode())
        data = tensor.reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
        digest.update(data.data)  # the array's buffer, as a memoryview
    return "blake2b:" + digest.hexdigest()


def apply_update(
    tensors: Mapping[str, torch.Tensor], update: WeightUpdate, *, held_version: int | None = None
) -> None:
    """Apply a delta update to named tensors and check the result against its checksum.

    `held_version` is the weight version the receiver holds (None: it does not track one). The
    update applies to its `base_version`, or to `update.version` itself when earlier updates of
    the same push (buckets) already applied. Checks every patch, and the base bits of step
    patches against `base_checksum`, before writing any: a misfit raises ValueError, another
    base `WeightBaseError`, and nothing changes. A checksum mismatch after writing raises
    ValueError, and the caller must then reload full weights.
    """
    if update.kind != "delta":
        raise ValueError(f"apply_update takes delta updates, got kind {update.kind!r}")
    if (
        held_version is not None
        and update.base_version is not None
        and held_version not in (update.base_version, update.version)
    ):
        raise WeightBaseError(
            f"delta weight update {update.version} patches version {update.base_version}, "
            f"but the receiver holds version {held_version}",
            fix="send full weights to a receiver that missed a version (the core's syncs do)",
        )
    unknown = sorted(set(update.tensors) - set(tensors))
    if unknown:
        raise ValueError(f"the update patches {len(unknown)} unknown tensors, e.g. {unknown[:3]}")
    for name, patch in update.tensors.items():
        if not isinstance(patch, TensorPatch):
            raise ValueError(
                f"entry {name!r} of a delta update is a {type(patch).__name__}, "
                "not a plait_weights.delta.TensorPatch"
            )
        problem = _misfit(tensors[name], patch)
        if problem:
            raise ValueError(f"patch of {name!r}: {problem}")
    held = base_checksum(tensors, update.tensors)
    if held is not None:
        if update.base_checksum is None:
            raise ValueError(
                f"delta weight update {update.version} has bit-step patches but no base_checksum: "
                "steps apply only to the exact base they were made against"
            )
        if held != update.base_checksum:
            holder = (
                "the receiver"
                if held_version is None
                else f"the receiver, which holds version {held_version}"
            )
            raise WeightBaseError(
                f"delta weight update {update.version} "
                f"(made against version {update.base_version}) "
                f"steps from other bits than {holder} "
                f"(base checksum {held} != {update.base_checksum})",
                fix="send full weights to this receiver (a new sync, or one that missed a "
                "version, does), then deltas again",
            )
    for name, patch in update.tensors.items():
        apply(tensors[name], patch)
    verify(tensors, update)


def base_checksum(base: Mapping[str, Any], patches: Mapping[str, TensorPatch]) -> str | None:
    """The `base_checksum` an update of `patches` made against `base` needs (None: no bit steps)."""
    stepped = [name for name, patch in patches.items() if patch.bit_steps]
    return checksum((name, base[name]) for name in stepped) if stepped else None


def verify(tensors: Mapping[str, torch.Tensor], update: WeightUpdate) -> None:
    """Raise ValueError when the named tensors do not match the update's checksum."""
    if update.checksum is None:
        return
    actual = checksum((name, tensors[name]) for name in update.tensors)
    if actual != update.checksum:
        raise ValueError(
            f"weights after applying version {update.version} differ from the sender's "
            f"(checksum {actual} != {update.checksum})"
        )


# ---------------------------------------------------------------------------------------------
# Packing for transports: a JSON-able header plus flat tensors
# ---------------------------------------------------------------------------------------------


def pack(update: WeightUpdate) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The update as a header and a list of 1-D CPU-or-device tensors, in header order (per
    entry: its gaps, values and escaped values, those it has; see `piece_names`)."""
    entries: list[dict[str, Any]] = []
    pieces: list[torch.Tensor] = []
    for name, value in update.tensors.items():
        patch = (
            value
            if isinstance(value, TensorPatch)
            else TensorPatch(tuple(torch.as_tensor(value).shape), value)
        )
        values = torch.as_tensor(patch.values).reshape(-1)
        entry = {
            "name": name,
            "shape": list(patch.shape),
            "dtype": dtype_name(values.dtype),
            "count": values.numel(),
        }
        if patch.gaps is not None:
            entry["gaps"] = dtype_name(patch.gaps.dtype)
            pieces.append(patch.gaps.reshape(-1))
        pieces.append(values)
        if patch.escaped is not None:
            escaped = torch.as_tensor(patch.escaped).reshape(-1)
            entry["escaped"] = [dtype_name(escaped.dtype), escaped.numel()]
            pieces.append(escaped)
        entries.append(entry)
    header = {
        "format": FORMAT,
        "version": update.version,
        "kind": update.kind,
        "base_version": update.base_version,
        "checksum": update.checksum,
        "base_checksum": update.base_checksum,
        "tensors": entries,
    }
    return header, pieces


def _entry_parts(entry: Mapping[str, Any]) -> list[tuple[str, torch.dtype, int]]:
    """(part, dtype, element count) of the pieces of one header entry, in `pack` order."""
    parts = []
    if entry.get("gaps") is not None:
        parts.append(("gaps", parse_dtype(entry["gaps"]), int(entry["count"])))
    parts.append(("values", parse_dtype(entry["dtype"]), int(entry["count"])))
    if entry.get("escaped") is not None:
        dtype, count = entry["escaped"]
        parts.append(("escaped", parse_dtype(dtype), int(count)))
    return parts


def piece_specs(header: Mapping[str, Any]) -> list[tuple[torch.dtype, int]]:
    """(dtype, element count) of each flat piece `pack` produced for `header`."""
    return [
        (dtype, count) for entry in header["tensors"] for _, dtype, count in _entry_parts(entry)
    ]


def piece_names(header: Mapping[str, Any]) -> list[str]:
    """A name for each flat piece `pack` produced for `header`: `TENSOR::gaps|values|escaped`."""
    return [
        f"{entry['name']}::{part}"
        for entry in header["tensors"]
        for part, _, _ in _entry_parts(entry)
    ]


def unpack(header: Mapping[str, Any], pieces: Sequence[torch.Tensor]) -> WeightUpdate:
    if header.get("format") != FORMAT:
        raise ValueError(
            f"not a plait weight update (format {header.get('format')!r}, expected {FORMAT!r})"
        )
    tensors: dict[str, Any] = {}
    it = iter(pieces)
    for entry in header["tensors"]:
        parts = {part: next(it) for part, _, _ in _entry_parts(entry)}
        if header["kind"] == "delta":
            tensors[entry["name"]] = TensorPatch(
                tuple(entry["shape"]), parts["values"], parts.get("gaps"), parts.get("escaped")
            )
        else:
            tensors[entry["name"]] = parts["values"].reshape(entry["shape"])
    return WeightUpdate(
        version=int(header["version"]),
        tensors=tensors,
        kind=header["kind"],
        checksum=header.get("checksum"),
        base_version=header.get("base_version"),
        base_checksum=header.get("base_checksum"),
    )


_ALIGN = 8  # every piece starts at a multiple of 8 bytes, so it can be viewed as its dtype


def _padded(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def to_bytes(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """The pieces as one flat uint8 tensor (for a single collective), each 8-byte aligned."""
    parts = []
    for piece in pieces:
        raw = piece.contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        if _padded(raw.numel()) > raw.numel():
            parts.append(raw.new_zeros(_padded(raw.numel()) - raw.numel()))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def buffer_size(specs: Sequence[tuple[torch.dtype, int]]) -> int:
    return sum(_padded(count * dtype.itemsize) for dtype, count in specs)


def from_bytes(
    buffer: torch.Tensor, specs: Sequence[tuple[torch.dtype, int]]
) -> list[torch.Tensor]:
    """The pieces of a `to_bytes` buffer (views, no copies)."""
    if buffer.numel() != buffer_size(specs):
        raise ValueError(
            f"weight buffer has {buffer.numel()} bytes, its header describes {buffer_size(specs)}"
        )
    pieces = []
    offset = 0
    for dtype, count in specs:
        size = count * dtype.itemsize
        pieces.append(buffer[offset : offset + size].view(dtype))
        offset += _padded(size)
    return pieces


def header_json(header: Mapping[str, Any]) -> str:
    return json.dumps(header, separators=(",", ":"))
