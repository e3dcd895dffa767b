"""A Megatron GPTModel as a module that scores target tokens at selected positions: the
`plait_train.scorer.TokenScorer` contract, so `plait_train.step.StepRunner` (layouts, plait
losses, micro-batches) runs it exactly as it runs a Hugging Face model.

It runs megatron-core's embedding and `TransformerBlock` (every layer and the final norm) and then
plait's chunked output head (`plait_train.ops.head_logprobs`) on the output weight (the
embedding when tied), only at the selected positions. Two inputs GPTModel.forward cannot take come
in through the block's own arguments:

- rotary embeddings from position ids: GPTModel's `RotaryEmbedding.forward` covers positions
  0..s-1 of every row alike; packed and prefix-shared rows restart positions inside a row. The
  frequencies are megatron-core's (`RotaryEmbedding.inv_freq`), the angles (s, b, 1, d) one per
  slot, which its unfused `apply_rotary_pos_emb` broadcasts over heads;
- the attention mask of a laid-out row (Megatron's convention: True = masked), or None (causal)
  for rows holding one sequence each.
"""

from __future__ import annotations

from typing import Any

import torch

from plait_train.layout import attention_mask
from plait_train.ops import head_logprobs


class MegatronScorer(torch.nn.Module):
    def __init__(self, gpt: Any, *, takes_tree_masks: bool) -> None:
        super().__init__()
        self.gpt = gpt
        self.takes_tree_masks = takes_tree_masks
        """False for kernels that ignore the mask of a causal layer (Transformer Engine's)."""
        self.chunked_head = True

    def output_weight(self) -> torch.Tensor:
        if self.gpt.share_embeddings_and_output_weights:
            return self.gpt.shared_embedding_or_output_weight()
        return self.gpt.output_layer.weight

    def rotary_angles(self, position_ids: torch.Tensor) -> torch.Tensor:
        """(s, b, 1, rotary dim) angles of `position_ids` (b, s), as megatron-core lays them out."""
        inv_freq = self.gpt.rotary_pos_emb.inv_freq.to(position_ids.device)
        freqs = position_ids.T[..., None].float() * inv_freq
        return torch.cat((freqs, freqs), dim=-1)[
            :, :, None, :
        ]  # Qwen3's halves layout, not interleaved

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
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(
                input_ids
            )
        mask = None
        if reach is not None:
            if not self.takes_tree_masks:
                raise ValueError("this attention kernel cannot take packed or prefix-shared rows")
            mask = ~attention_mask(reach)
        hidden = self.gpt.embedding(input_ids=input_ids, position_ids=None)  # (W, R, H)
        hidden = self.gpt.decoder(
            hidden_states=hidden,
            attention_mask=mask,
            rotary_pos_emb=self.rotary_angles(position_ids),
        )
        hidden = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])[select]
        return head_logprobs(hidden, self.output_weight(), targets)
