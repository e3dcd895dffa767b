"""A Hugging Face causal LM as a module that scores target tokens at selected positions.

`TokenScorer(model)(input_ids, position_ids, reach, select, targets)` runs the model on rows laid
out by `plait_train.layout` and returns, for every flat position `select[n]`, the logprob of
`targets[n]` and the exact entropy of the next-token distribution there, both differentiable (the
entropy's backward runs only when it reaches the loss: an entropy bonus).

Models whose logits are exactly `decoder(x) @ head.weight.T` take the chunked output head
(`plait_train.ops.head_logprobs`), which runs only at the selected positions and never holds
the full (tokens x vocab) logits; models that scale, cap or bias their logits take the full
logits. Being one module, the scorer can be wrapped as a whole (FSDP's root module): everything,
output head included, runs inside its forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import structlog
import torch

from plait_train.layout import attention_mask
from plait_train.ops import head_logprobs, target_logprobs, token_entropy

log = structlog.get_logger("plait_train")

# Attention kernels that take an arbitrary (tree) mask: sdpa as a boolean mask, eager as an
# additive one. Flash-attention kernels take only causal and variable-length masks.
TREE_MASK_ATTENTION = ("sdpa", "eager")


def attention_implementation(model: Any) -> str:
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def split_output_head(
    model: Any,
) -> tuple[torch.nn.Module, torch.nn.Linear] | tuple[None, None]:
    """(decoder, output projection) when logits are exactly `decoder(x) @ head.weight.T`, so the
    chunked output head applies; (None, None) for models that scale, cap or bias their logits."""
    head = model.get_output_embeddings()
    decoder = model.get_decoder()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or decoder is model:
        return None, None
    device = head.weight.device
    rows = int(model.get_input_embeddings().weight.shape[0])
    probe = torch.arange(1, 9, device=device).unsqueeze(0) % rows
    with torch.no_grad():
        expected = model(input_ids=probe, use_cache=False).logits.float()
        hidden = decoder(input_ids=probe, use_cache=False).last_hidden_state
        actual = hidden.float() @ head.weight.float().T
    tolerance = 1e-4 if head.weight.dtype == torch.float32 else 5e-2
    if not torch.allclose(
        actual, expected, rtol=tolerance, atol=tolerance * expected.abs().max().item()
    ):
        log.info(
            "the model transforms its logits; using the full-logits path",
            model=type(model).__name__,
        )
        return None, None
    return decoder, head


class TokenScorer(torch.nn.Module):
    """Target logprobs and entropies of a causal LM at selected positions of laid-out rows."""

    def __init__(self, model: Any, *, chunked_head: bool = True) -> None:
        super().__init__()
        self.model = model
        decoder, head = split_output_head(model) if chunked_head else (None, None)
        # A plain tuple: decoder and head are submodules of `model` already, and registering them
        # again would give their parameters a second name.
        self._head_parts = (decoder, head) if decoder is not None and head is not None else None
        self.attention = attention_implementation(model)
        self.head_adapters: (
            Callable[[torch.Tensor], Sequence[tuple[torch.Tensor | None, Any]]] | None
        ) = None
        """LoRA on the unembedding: for the selected flat positions, groups of them (indices, None
        for all) and the adapter each goes through (a module with lora_A, lora_B and scaling, or
        None); the chunked head adds them (`plait_train.lora.LoraBank.unembedding_adapters`)."""

    @property
    def chunked_head(self) -> bool:
        return self._head_parts is not None

    @property
    def takes_tree_masks(self) -> bool:
        return self.attention in TREE_MASK_ATTENTION

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        reach: torch.Tensor | None,
        select: torch.Tensor,
        targets: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`input_ids` (R, W); `select`, `targets` (N,): flat positions into R x W and their
        targets."""
        kwargs = self._model_kwargs(input_ids, position_ids, reach)
        if self._head_parts is not None:
            decoder, head = self._head_parts
            hidden = decoder(**kwargs).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1])[select]
            parts = self.head_adapters(select) if self.head_adapters is not None else []
            return head_logprobs(
                hidden,
                head.weight,
                targets,
                [
                    _low_rank(hidden, rows, adapter)
                    for rows, adapter in parts
                    if adapter is not None
                ],
            )
        logits = self.model(**kwargs).logits
        # One float32 copy that both outputs' backward passes keep (and nothing more).
        picked = logits.reshape(-1, logits.shape[-1])[select].float()
        return target_logprobs(picked, targets), token_entropy(picked)

    def _model_kwargs(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, reach: torch.Tensor | None
    ) -> dict[str, Any]:
        """The model's keyword arguments for laid-out rows."""
        kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": False}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if reach is not None:
            kwargs["attention_mask"] = self._mask(reach)
        return kwargs

    def _mask(self, reach: torch.Tensor) -> torch.Tensor:
        allowed = attention_mask(reach)
        if self.attention == "sdpa":
            return allowed
        if self.attention == "eager":
            zero = torch.zeros((), dtype=torch.float32, device=reach.device)
            return torch.where(allowed, zero, torch.finfo(torch.float32).min)
        raise ValueError(
            f"attention {self.attention!r} cannot take packed or prefix-shared rows; "
            f"use one of {TREE_MASK_ATTENTION}"
        )


def _low_rank(
    hidden: torch.Tensor, rows: torch.Tensor | None, adapter: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A LoRA adapter of the output projection as `head_logprobs` takes it: (rows, s * A h, B)."""
    rows = rows if rows is not None else torch.arange(hidden.shape[0], device=hidden.device)
    down = adapter.lora_A(hidden[rows].to(adapter.lora_A.weight.dtype)) * adapter.scaling
    return rows, down, adapter.lora_B.weight


class ValueScorer(TokenScorer):
    """A value model (PPO's critic): the causal LM's decoder with a linear head from its last
    hidden state to one value per position instead of the output head. It has the scorer's
    signature and gives the values where a policy's scorer gives logprobs (and a zero entropy).
    The head starts at zero, so a new critic values every state at 0."""

    def __init__(self, model: Any) -> None:
        super().__init__(model, chunked_head=False)
        embeddings = model.get_input_embeddings().weight
        self.value_head = torch.nn.Linear(
            int(model.config.hidden_size), 1, dtype=torch.float32, device=embeddings.device
        )
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        reach: torch.Tensor | None,
        select: torch.Tensor,
        targets: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = self._model_kwargs(input_ids, position_ids, reach)
        decoder = self.model.get_decoder()
        if decoder is self.model:  # no separate decoder: the last hidden state of the whole model
            hidden = self.model(**kwargs, output_hidden_states=True).hidden_states[-1]
        else:
            hidden = decoder(**kwargs).last_hidden_state
        picked = hidden.reshape(-1, hidden.shape[-1])[select].float()
        # in float32 under a bfloat16 autocast too: values are read out as float32
        with torch.autocast(picked.device.type, enabled=False):
            values = self.value_head(picked).squeeze(-1)
        return values, torch.zeros_like(values)
