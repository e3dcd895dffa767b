"""JSON (and msgpack) conversion of plait's attrs types.

`to_json(obj)` gives plain dicts/lists/numbers; `from_json(cls, data)` rebuilds the attrs object.
Block unions are discriminated by their `type` field, as on the ORS wire.
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs
import cattrs

from plait.types import Block, ImageBlock, TensorData, TextBlock

T = TypeVar("T")

converter = cattrs.Converter(forbid_extra_keys=False)

converter.register_unstructure_hook(
    TensorData, lambda t: {"data": t.data.tolist(), "dtype": t.dtype, "shape": list(t.shape)}
)


def _structure_tensor(data: Any, _: Any) -> TensorData:
    flat = TensorData.from_list(data["data"], data["dtype"])
    return attrs.evolve(flat, shape=tuple(data.get("shape") or flat.shape))


converter.register_structure_hook(TensorData, _structure_tensor)

_BLOCK_TYPES: dict[str, type] = {"text": TextBlock, "image": ImageBlock}


def _structure_block(data: Any, _: Any) -> Block:
    if isinstance(data, TextBlock | ImageBlock):
        return data
    kind = data.get("type", "text") if isinstance(data, dict) else None
    if kind not in _BLOCK_TYPES:
        raise ValueError(f"unknown block type {kind!r}; expected 'text' or 'image'")
    return converter.structure(data, _BLOCK_TYPES[kind])


converter.register_structure_hook(Block, _structure_block)


def to_json(obj: Any) -> Any:
    """Plain JSON-able data for an attrs object (or a list/dict of them)."""
    return converter.unstructure(obj)


def from_json(cls: type[T], data: Any) -> T:
    """Rebuild an attrs object of type `cls` from `to_json` output."""
    return converter.structure(data, cls)
