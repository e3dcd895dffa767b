"""Options of plait-torch's engines (`trainer.options` / `inference.options` in a run config).

Kept free of torch imports: config validation loads these classes before any model is built.
"""

from __future__ import annotations

from typing import Literal

import attrs

from plait.api import positive

Device = Literal["auto", "cpu", "cuda"]


@attrs.frozen
class LoraOptions:
    """Train low-rank adapters instead of the whole model (the base stays frozen); Tinker's
    `lora_config`. Saved states hold the adapter in PEFT's layout."""

    rank: int = attrs.field(default=32, validator=positive)
    alpha: float = attrs.field(default=32.0, validator=positive)
    """The adapter's output is scaled by alpha / rank."""
    train_attn: bool = True
    """Adapt the attention projections (q, k, v, o)."""
    train_mlp: bool = True
    """Adapt the MLP projections (gate, up, down)."""
    train_unembed: bool = False
    """Adapt the unembedding (lm_head)."""

    def __attrs_post_init__(self) -> None:
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError(
                "train_attn, train_mlp and train_unembed are all off: nothing to adapt "
                "(turn one on, or drop the lora table)"
            )


@attrs.frozen
class TorchTrainerOptions:
    device: Device = "auto"
    """auto = the first CUDA device when there is one, else the CPU."""
    micro_batch_tokens: int = attrs.field(default=2048, validator=positive)
    """Padded tokens (rows x longest row) per forward/backward chunk. Bounds activation memory:
    the logits alone take micro_batch_tokens x vocab x 4 bytes (and as much again for their
    grad)."""
    packing: bool = True
    """Pack several sequences into one row (own position ids, no attention across them) instead
    of padding each row to the longest; rows are as wide as the longest sequence of the call."""
    prefix_sharing: bool = True
    """Compute positions that several datums share from their start (a GRPO group's prompt, a
    conversation's history) once, forward and backward. Needs sdpa or eager attention."""
    activation_checkpointing: bool | Literal["full", "selective"] = False
    """Recompute activations in the backward pass: "full" (or true) keeps only each decoder
    layer's input (least memory, ~30% more compute); "selective" keeps matmul and attention
    outputs and recomputes the cheap ops in between."""
    mixed_precision: bool = True
    """With model.dtype = bfloat16: keep float32 master weights and optimizer state and run
    forward/backward under bfloat16 autocast. False stores the weights themselves in bfloat16.
    Ignored for float32 models."""
    threads: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive))
    """torch intra-op threads (process-wide); None keeps torch's default."""
    attn_implementation: Literal["sdpa", "eager"] | None = None
    """The transformers attention kernel; None lets transformers choose."""
    routing_replay: bool = False
    """Mixture-of-experts models: route every token to the experts the sampler recorded for it
    (R3) instead of the trainer's own choice; the data must carry routed_experts (sample with
    inference.options.enable_return_routed_experts = true)."""
    lora: LoraOptions | None = None
    """LoRA adapters to train instead of the whole model (None = full fine-tuning). Weight
    export (and so weight sync) sends the merged weights, base + adapter, under the base's names."""
    reference: bool = False
    """Keep the reference policy, the initial weights, and compute a call's ref_logprobs (the
    KL penalty's input) when its loss_fn_config sets kl_coef and its data carry none: with
    `lora`, the same model with the adapters off (no extra memory); without, a frozen copy of the
    initial model made at construction, which costs one more copy of the weights (in the
    parameter dtype). A resumed trainer keeps the initial weights as its reference (the copy is
    made from model.path before load_state)."""
    value_head: bool = False
    """A value model, PPO's critic (`[critic]` in a run config): a linear head from the last
    hidden state to one value per position replaces the output head; forward gives `values`
    where a policy's trainer gives `logprobs`, and the `value` loss trains it. Saved states hold
    the head beside the weights (value_head.safetensors)."""

    def __attrs_post_init__(self) -> None:
        if self.value_head and (self.reference or self.routing_replay):
            raise ValueError(
                "value_head makes a critic, which has no reference policy and replays no routing: "
                "turn reference and routing_replay off"
            )


@attrs.frozen
class TorchInferenceOptions:
    device: Device = "auto"
    """auto = the first CUDA device when there is one, else the CPU."""
    max_batch_size: int = attrs.field(default=64, validator=positive)
    """Sequences decoded together (a request's n samples always run in the same batch)."""
    max_model_len: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive)
    )
    """Prompt plus completion tokens; None = the model's max_position_embeddings."""
    batch_wait_ms: float = attrs.field(default=50.0, validator=attrs.validators.ge(0))
    """Before a batch that is not full starts, wait until no request has arrived for this long
    (and for a few event-loop turns), so requests sent together share a batch: a rollout step's
    episodes reach the engine over tens of milliseconds when their environments run user code in
    threads (measured: gaps of 20-30 ms between arrivals on 2 cores), and a late one would
    otherwise wait a whole batch. Costs a lone request this much latency; 0 = turns only."""
    prefix_sharing: bool = True
    """Run the tokens that every prompt of a batch starts with (a system prompt, worked examples)
    once, then each prompt's rest on a copy of that cache."""
    threads: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive))
    """torch intra-op threads (process-wide); None keeps torch's default."""
    attn_implementation: Literal["sdpa", "eager"] | None = None
    """The transformers attention kernel; None lets transformers choose."""
    dtype: Literal["float32", "bfloat16"] | None = None
    """The dtype to sample in; None = model.dtype. (Sampling in bfloat16 while training in float32
    is the common split; weight updates are cast on arrival.)"""
    adapter: str | None = None
    """A LoRA adapter directory (PEFT's layout: adapter_config.json, adapter_model.safetensors)
    to merge into the weights when the engine starts."""
    enable_return_routed_experts: bool = False
    """Mixture-of-experts models: record the experts every token was routed to, returned with each
    sample (`SampledSequence.routed_experts`) for routing replay in the trainer."""
