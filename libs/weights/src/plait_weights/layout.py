"""Weight layouts for sync: Hugging Face names as the trainer exports them, or resharded into the
tensor-parallel (TP) shards each rank of an inference engine holds.

The TP layout follows Megatron/vLLM for Llama-, Qwen- and Mistral-style checkpoints, by
parameter name:

| parameters | split |
|---|---|
| `q_proj` | by attention head, dim 0 |
| `k_proj`, `v_proj` | by key/value head, dim 0 (with fewer KV heads than ranks: see below) |
| `o_proj.weight` | by attention head, dim 1 |
| `gate_proj`, `up_proj` | dim 0 (column parallel) |
| `down_proj.weight` | dim 1 (row parallel) |
| `embed_tokens`, `lm_head` | vocabulary rows, dim 0 (the last shard may be shorter) |
| everything else (norms, row-parallel biases) | replicated on every rank |

With fewer KV heads than ranks, rank r holds key/value head r·kv/tp (replicated, as vLLM does).
Shards keep their Hugging Face names; a rank's shards are what its engine loads. Imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

_HEADS = ("q_proj",)
_KV_HEADS = ("k_proj", "v_proj")
_HEADS_IN = ("o_proj",)
_COLUMN = ("gate_proj", "up_proj")
_ROW = ("down_proj",)
_VOCAB = ("embed_tokens", "lm_head")


def _module(name: str) -> tuple[str, str]:
    """("q_proj", "weight") of "model.layers.0.self_attn.q_proj.weight"."""
    parts = name.rsplit(".", 2)
    return (parts[-2], parts[-1]) if len(parts) >= 2 else (name, "")


@attrs.frozen
class TensorParallelLayout:
    tp_size: int
    head_dim: int

    def __attrs_post_init__(self) -> None:
        if self.tp_size < 1 or self.head_dim < 1:
            raise ValueError(
                f"tp_size and head_dim must be >= 1, got {self.tp_size} and {self.head_dim}"
            )

    def split(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The shard of every rank, in rank order (views of `tensor`)."""
        module, kind = _module(name)
        tp = self.tp_size
        if module in _HEADS or (module in _HEADS_IN and kind == "weight"):
            dim = 0 if module in _HEADS else 1
            heads = self._heads(name, tensor.shape[dim])
            if heads % tp:
                raise ValueError(f"{name}: {heads} attention heads do not split over tp_size {tp}")
            return list(tensor.chunk(tp, dim))
        if module in _KV_HEADS:
            heads = self._heads(name, tensor.shape[0])
            if heads >= tp:
                if heads % tp:
                    raise ValueError(
                        f"{name}: {heads} key/value heads do not split over tp_size {tp}"
                    )
                return list(tensor.chunk(tp, 0))
            if tp % heads:
                raise ValueError(
                    f"{name}: tp_size {tp} is not a multiple of its {heads} key/value heads"
                )
            per_head = tensor.chunk(heads, 0)
            return [per_head[rank * heads // tp] for rank in range(tp)]
        if module in _COLUMN or (module in _ROW and kind == "weight"):
            dim = 0 if module in _COLUMN else 1
            if tensor.shape[dim] % tp:
                raise ValueError(
                    f"{name}: dim {dim} of size {tensor.shape[dim]} "
                    f"does not split over tp_size {tp}"
                )
            return list(tensor.chunk(tp, dim))
        if module in _VOCAB and kind == "weight":
            rows = -(-tensor.shape[0] // tp)
            return [tensor[rank * rows : (rank + 1) * rows] for rank in range(tp)]
        return [tensor] * tp

    def join(self, name: str, shards: Sequence[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
        """The full tensor of `shape` from every rank's shard (the inverse of `split`)."""
        module, kind = _module(name)
        if module in _KV_HEADS and self._heads(name, shape[0]) < self.tp_size:
            replicas = self.tp_size // self._heads(name, shape[0])
            return torch.cat(list(shards[::replicas]), 0)
        if module in _HEADS_IN + _ROW and kind == "weight":
            return torch.cat(list(shards), 1)
        if module in _HEADS + _KV_HEADS + _COLUMN or (module in _VOCAB and kind == "weight"):
            return torch.cat(list(shards), 0)
        return shards[0]

    def ranks(self, tensors: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """Every rank's named shards."""
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp_size)]
        for name, tensor in tensors.items():
            for rank, shard in enumerate(self.split(name, tensor)):
                out[rank][name] = shard
        return out

    def _heads(self, name: str, rows: int) -> int:
        if rows % self.head_dim:
            raise ValueError(
                f"{name}: {rows} rows are not a whole number of heads of head_dim {self.head_dim}"
            )
        return rows // self.head_dim
