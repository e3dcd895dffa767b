"""JSON (and msgpack) conversion of plait's attrs types.

`to_json(obj)` gives plain dicts/lists/numbers; `from_json(cls, data)` rebuilds the attrs object.
Block unions are discriminated by their `type` field, as on the ORS wire.
"""

from __future__ import annotations

import base64
import math
from typing import Any, TypeVar

import attrs
import cattrs
import numpy as np

from plait.types import Block, ImageBlock, TensorData, TextBlock

T = TypeVar("T")

converter = cattrs.Converter(forbid_extra_keys=False)

_COMPACT_DTYPES = ("uint8", "uint16", "int32")
"""Compact ids (`TensorData.compact`, e.g. routed experts: thousands of tokens x layers x top-k)
travel as their raw little-endian bytes in base64, not as a JSON list of ints."""


def _unstructure_tensor(tensor: TensorData) -> dict[str, Any]:
    if tensor.dtype in _COMPACT_DTYPES:
        raw = np.ascontiguousarray(
            tensor.data, dtype=np.dtype(tensor.dtype).newbyteorder("<")
        ).tobytes()
        return {
            "base64": base64.b64encode(raw).decode("ascii"),
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
        }
    return {"data": tensor.data.tolist(), "dtype": tensor.dtype, "shape": list(tensor.shape)}


def _structure_tensor(data: Any, _: Any) -> TensorData:
    if "base64" in data:
        dtype = np.dtype(data["dtype"])
        values = np.frombuffer(
            base64.b64decode(data["base64"]), dtype=dtype.newbyteorder("<")
        ).astype(dtype)
        flat = TensorData(values, data["dtype"], (values.size,))
    else:
        flat = TensorData.from_list(data["data"], data["dtype"])
    shape = tuple(int(n) for n in data.get("shape") or flat.shape)
    if math.prod(shape) != flat.data.size:
        raise ValueError(
            f"a {data['dtype']} tensor of shape {shape} cannot hold {flat.data.size} values"
        )
    return attrs.evolve(flat, shape=shape)


converter.register_unstructure_hook(TensorData, _unstructure_tensor)


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
