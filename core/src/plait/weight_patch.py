"""The delta format of weight sync: diff two versions of a tensor, apply the patch, check bits.

A `plait.types.TensorPatch` lists the elements of one tensor that changed, as gap-encoded flat
positions and their new values, and *overwrites* them on the receiver (no float drift, unlike
sending additive deltas). Why this pays: an engine serving bfloat16 weights only sees a change
where a trainer's float32 master weight crosses a bfloat16 rounding boundary, which at RL
learning rates is a few percent of elements per step or less (PULSE, arXiv 2602.03839). In
float32 nearly every element changes after an Adam step, and the patch falls back to a dense
entry (never larger than the tensor itself).

Encoding (what `TensorPatch` holds and the wire carries):

- positions ascend; `gaps[0]` is the first position and `gaps[i]` the distance to the previous
  one. The narrowest of uint8 / uint16 / int32 that minimises the patch's bytes is chosen; a gap
  too long for it is split by *filler* entries, which overwrite an unchanged element with its
  own value (harmless, because patches overwrite).
- values are in the tensor's dtype; an entry is dense (`gaps=None`) when that is smaller.

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

from plait.types import TensorPatch, WeightUpdate

FORMAT = "plait-weights/1"

# (dtype, largest gap it holds): the candidate encodings of positions, narrowest first.
_GAP_DTYPES = ((torch.uint8, 255), (torch.uint16, 65_535), (torch.int32, 2**31 - 1))
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
        raise ValueError(f"cannot diff a {old.dtype} {tuple(old.shape)} tensor against a "
                         f"{new.dtype} {tuple(new.shape)} one")
    flat = new.reshape(-1)
    positions = (_bits(old) != _bits(new)).nonzero().squeeze(1)
    if positions.numel() == 0:
        return TensorPatch(new.shape, flat[:0].clone(), torch.empty(0, dtype=torch.uint8))
    gaps, positions = _encode_positions(positions, new.element_size())
    if gaps.numel() * (gaps.element_size() + new.element_size()) >= flat.numel() * new.element_size():
        return TensorPatch(new.shape, flat.clone())
    return TensorPatch(new.shape, flat[positions.to(flat.device)], gaps.cpu())


def _encode_positions(positions: torch.Tensor, value_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gaps in the cheapest dtype, the positions they encode, fillers included)."""
    positions = positions.to(torch.int64)
    gaps = torch.diff(positions, prepend=positions.new_zeros(1))
    best: tuple[int, torch.dtype, int, torch.Tensor] | None = None
    for dtype, limit in _GAP_DTYPES:
        pieces = ((gaps + limit - 1) // limit).clamp(min=1)  # entries per gap, fillers included
        count = int(pieces.sum())
        size = count * (torch.empty((), dtype=dtype).element_size() + value_size)
        if best is None or size < best[0]:
            best = (size, dtype, limit, pieces)
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
    return patch.gaps.to(torch.int64).cumsum(0)


def apply(target: torch.Tensor, patch: TensorPatch) -> None:
    """Overwrite the patched elements of `target` in place. Raises ValueError (changing nothing)
    when the patch does not fit the tensor."""
    if tuple(patch.shape) != tuple(target.shape):
        raise ValueError(f"patch for shape {tuple(patch.shape)} does not fit a tensor of shape {tuple(target.shape)}")
    values = torch.as_tensor(patch.values)
    flat = target.view(-1)
    if patch.dense:
        if values.numel() != flat.numel():
            raise ValueError(f"dense patch has {values.numel()} values for {flat.numel()} elements")
        flat.copy_(values.reshape(-1))
        return
    if values.dtype != target.dtype:
        raise ValueError(f"patch values are {dtype_name(values.dtype)} but the tensor is {dtype_name(target.dtype)}; "
                         "a sparse patch must be made in the receiver's dtype")
    positions = positions_of(patch)
    if positions.numel() != values.numel():
        raise ValueError(f"patch has {positions.numel()} positions but {values.numel()} values")
    if positions.numel() and int(positions[-1]) >= flat.numel():
        raise ValueError(f"patch writes position {int(positions[-1])} of a tensor with {flat.numel()} elements")
    flat[positions.to(flat.device)] = values.to(flat.device)


def patch_elements(patch: TensorPatch) -> int:
    return int(torch.as_tensor(patch.values).numel())


def patch_nbytes(patch: TensorPatch) -> int:
    values = torch.as_tensor(patch.values)
    gaps = 0 if patch.gaps is None else patch.gaps.numel() * patch.gaps.element_size()
    return values.numel() * values.element_size() + gaps


def update_nbytes(update: WeightUpdate) -> int:
    """Bytes of tensor data an update carries."""
    if update.kind == "delta":
        return sum(patch_nbytes(p) for p in update.tensors.values())
    return sum(int(torch.as_tensor(t).numel() * torch.as_tensor(t).element_size()) for t in update.tensors.values())


def checksum(tensors: Iterable[tuple[str, Any]]) -> str:
    """BLAKE2b over (name, dtype, shape, bytes) of each tensor, in name order."""
    digest = hashlib.blake2b(digest_size=16)
    for name, value in sorted(tensors, key=lambda item: item[0]):
        tensor = torch.as_tensor(value).detach()
        digest.update(f"{name}\0{dtype_name(tensor.dtype)}\0{tuple(tensor.shape)}\0".encode())
        data = tensor.reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
        digest.update(memoryview(data))
    return "blake2b:" + digest.hexdigest()


def apply_update(tensors: Mapping[str, torch.Tensor], update: WeightUpdate) -> None:
    """Apply a delta update to named tensors and check the result against its checksum.

    Checks every patch before writing any (a bad update changes nothing); a checksum mismatch
    after writing raises ValueError, and the caller must then reload full weights.
    """
    if update.kind != "delta":
        raise ValueError(f"apply_update takes delta updates, got kind {update.kind!r}")
    unknown = sorted(set(update.tensors) - set(tensors))
    if unknown:
        raise ValueError(f"the update patches {len(unknown)} unknown tensors, e.g. {unknown[:3]}")
    for name, patch in update.tensors.items():
        if not isinstance(patch, TensorPatch):
            raise ValueError(f"entry {name!r} of a delta update is a {type(patch).__name__}, not a plait.types.TensorPatch")
        target = tensors[name]
        if tuple(patch.shape) != tuple(target.shape):
            raise ValueError(f"patch of {name!r} is for shape {tuple(patch.shape)}, the tensor's is {tuple(target.shape)}")
        if not patch.dense and torch.as_tensor(patch.values).dtype != target.dtype:
            raise ValueError(f"patch of {name!r} holds {dtype_name(torch.as_tensor(patch.values).dtype)} values "
                             f"but the tensor is {dtype_name(target.dtype)}")
    for name, patch in update.tensors.items():
        apply(tensors[name], patch)
    verify(tensors, update)


def verify(tensors: Mapping[str, torch.Tensor], update: WeightUpdate) -> None:
    """Raise ValueError when the named tensors do not match the update's checksum."""
    if update.checksum is None:
        return
    actual = checksum((name, tensors[name]) for name in update.tensors)
    if actual != update.checksum:
        raise ValueError(f"weights after applying version {update.version} differ from the sender's "
                         f"(checksum {actual} != {update.checksum})")


# ---------------------------------------------------------------------------------------------
# Packing for transports: a JSON-able header plus flat tensors
# ---------------------------------------------------------------------------------------------


def pack(update: WeightUpdate) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The update as a header and a list of 1-D CPU-or-device tensors, in header order."""
    entries: list[dict[str, Any]] = []
    pieces: list[torch.Tensor] = []
    for name, value in update.tensors.items():
        patch = value if isinstance(value, TensorPatch) else TensorPatch(tuple(torch.as_tensor(value).shape), value)
        values = torch.as_tensor(patch.values).reshape(-1)
        entry = {"name": name, "shape": list(patch.shape), "dtype": dtype_name(values.dtype), "count": values.numel()}
        if patch.gaps is not None:
            entry["gaps"] = dtype_name(patch.gaps.dtype)
            pieces.append(patch.gaps.reshape(-1))
        pieces.append(values)
        entries.append(entry)
    header = {"format": FORMAT, "version": update.version, "kind": update.kind,
              "base_version": update.base_version, "checksum": update.checksum, "tensors": entries}
    return header, pieces


def piece_specs(header: Mapping[str, Any]) -> list[tuple[torch.dtype, int]]:
    """(dtype, element count) of each flat piece `pack` produced for `header`."""
    specs: list[tuple[torch.dtype, int]] = []
    for entry in header["tensors"]:
        if entry.get("gaps") is not None:
            specs.append((parse_dtype(entry["gaps"]), int(entry["count"])))
        specs.append((parse_dtype(entry["dtype"]), int(entry["count"])))
    return specs


def unpack(header: Mapping[str, Any], pieces: Sequence[torch.Tensor]) -> WeightUpdate:
    if header.get("format") != FORMAT:
        raise ValueError(f"not a plait weight update (format {header.get('format')!r}, expected {FORMAT!r})")
    tensors: dict[str, Any] = {}
    it = iter(pieces)
    for entry in header["tensors"]:
        gaps = next(it) if entry.get("gaps") is not None else None
        values = next(it)
        if header["kind"] == "delta":
            tensors[entry["name"]] = TensorPatch(tuple(entry["shape"]), values, gaps)
        else:
            tensors[entry["name"]] = values.reshape(entry["shape"])
    return WeightUpdate(version=int(header["version"]), tensors=tensors, kind=header["kind"],
                        checksum=header.get("checksum"), base_version=header.get("base_version"))


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
    return sum(_padded(count * torch.empty((), dtype=dtype).element_size()) for dtype, count in specs)


def from_bytes(buffer: torch.Tensor, specs: Sequence[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """The pieces of a `to_bytes` buffer (views, no copies)."""
    if buffer.numel() != buffer_size(specs):
        raise ValueError(f"weight buffer has {buffer.numel()} bytes, its header describes {buffer_size(specs)}")
    pieces = []
    offset = 0
    for dtype, count in specs:
        size = count * torch.empty((), dtype=dtype).element_size()
        pieces.append(buffer[offset:offset + size].view(dtype))
        offset += _padded(size)
    return pieces


def header_json(header: Mapping[str, Any]) -> str:
    return json.dumps(header, separators=(",", ":"))
