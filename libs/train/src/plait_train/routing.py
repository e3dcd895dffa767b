"""Mixture-of-experts routing: record the experts every token was routed to, and replay them.

Routing replay (R3): the sampler records, for every token it ran, the top-k experts each MoE
layer chose; the trainer then forwards with those experts forced instead of choosing its own,
so that a numeric difference between the two (other kernels, precision, batch shape) cannot send
a token to other experts. The mixing weights are still computed by the trainer's router, from
its own logits at the forced experts, so the router keeps learning.

Routers are found by shape: transformers' top-k router modules (`Qwen3MoeTopKRouter` and the
routers built like it) have `top_k` and `num_experts` and return `(logits, scores, indices)` for
the flattened tokens of a forward pass. `RoutingHooks` puts a forward hook on each of them, in
layer order; a token's routing is an array (layers, top_k) of expert ids, stored in the narrowest
unsigned integer type that holds them (`TensorData.compact`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol, cast

import attrs
import torch

from plait.api import DataError


@attrs.frozen
class MoeShape:
    layers: int
    top_k: int
    experts: int


class _RouterSize(Protocol):
    """The plain attributes of a top-k router (torch types module attributes as tensors or
    submodules only)."""

    top_k: int
    num_experts: int


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers, in layer order."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("TopKRouter")
        and hasattr(m, "top_k")
        and hasattr(m, "num_experts")
    ]


def moe_shape(model: torch.nn.Module) -> MoeShape | None:
    """Layers, experts per token and experts of the model's routers; None for a dense model."""
    return _shape(find_routers(model))


def _shape(routers: list[torch.nn.Module]) -> MoeShape | None:
    if not routers:
        return None
    first = cast(_RouterSize, routers[0])  # find_routers keeps only routers with both attributes
    return MoeShape(len(routers), int(first.top_k), int(first.num_experts))


class RoutingHooks:
    """Forward hooks on every router of `model`.

    Outside `forced(...)` the hooks only record what each router chose (`chosen`, per layer, the
    flat tokens x top_k ids of the last forward). Inside it they replace each router's choice by
    the given experts and record both what the router would have chosen (`chosen`) and what the
    experts were given (`used`).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        routers = find_routers(model)
        shape = _shape(routers)
        if shape is None:
            raise ValueError(
                f"{type(model).__name__} has no top-k router: it is not a mixture of experts"
            )
        self.shape = shape
        self.chosen: list[torch.Tensor | None] = [None] * len(routers)
        self.used: list[torch.Tensor | None] = [None] * len(routers)
        self._forced: torch.Tensor | None = None
        self._handles = [
            router.register_forward_hook(self._hook(layer)) for layer, router in enumerate(routers)
        ]

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, _args: Any, output: tuple[torch.Tensor, ...]) -> Any:
            logits, _scores, chosen = output
            self.chosen[layer] = chosen.detach()
            if self._forced is None:
                self.used[layer] = self.chosen[layer]
                return None
            forced = self._forced[:, layer].to(device=chosen.device, dtype=torch.long)
            if forced.shape != chosen.shape:
                raise DataError(
                    f"routing replay got {tuple(forced.shape)} expert ids for layer {layer}, "
                    f"the forward pass routes {tuple(chosen.shape)}"
                )
            # The same weights the router computes for its own choice (softmax, top-k, optional
            # renormalisation), taken at the forced experts: differentiable in the router's logits.
            scores = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, forced)
            if getattr(module, "norm_topk_prob", False):
                scores = scores / scores.sum(dim=-1, keepdim=True)
            self.used[layer] = forced
            return logits, scores.to(logits.dtype), forced

        return hook

    @contextlib.contextmanager
    def forced(self, experts: torch.Tensor) -> Iterator[None]:
        """Route the flat tokens of the forward passes inside by `experts`
        (tokens, layers, top_k)."""
        if experts.shape[1:] != (self.shape.layers, self.shape.top_k):
            raise DataError(
                f"routed experts of shape {tuple(experts.shape)}: "
                f"the model has {self.shape.layers} MoE layers routing {self.shape.top_k} "
                "experts per token",
                fix="sample with the model being trained (same MoE configuration)",
            )
        if experts.numel() and int(experts.max()) >= self.shape.experts:
            raise DataError(
                f"routed expert id {int(experts.max())} is out of range: the model has "
                f"{self.shape.experts} experts",
                fix="sample with the model being trained (same MoE configuration)",
            )
        self._forced = experts
        try:
            yield
        finally:
            self._forced = None

    def stacked(self, which: list[torch.Tensor | None]) -> torch.Tensor:
        """(tokens, layers, top_k) of the last forward pass, from `chosen` or `used`."""
        if any(t is None for t in which):
            raise RuntimeError("no forward pass has run through every router yet")
        return torch.stack([t for t in which if t is not None], dim=1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(..., layers) True where the two routings chose the same set of experts."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)
