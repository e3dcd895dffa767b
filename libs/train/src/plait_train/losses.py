"""The built-in losses, with Tinker's input keys, defaults and token-sum reduction.

Notation: `lp` are the trainer's log-probabilities of the target tokens, `q = inputs["logprobs"]`
the sampler's, `A = inputs["advantages"]`, `r = exp(lp - q)`. Every loss is a *sum* over tokens
(normalise through the weights/advantages on the client side), and works on any shape: one datum
(N,) or a padded batch (B, T) whose padding positions have zero weight/advantage and lp = q = 0.

An optional `mask` input (1 on sampled tokens) is not part of any formula; when present, metrics
such as the importance-weight max are taken over masked tokens only.

This module imports torch; the core registers the losses lazily, so `import plait` does not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
import torch

Tensor = torch.Tensor


@attrs.frozen
class LossOutput:
    loss: Tensor  # scalar, to be minimised
    metrics: dict[str, float]


LossFn = Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], LossOutput]

REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}


def check_inputs(loss_name: str, keys: Sequence[str]) -> None:
    missing = [k for k in REQUIRED_INPUTS.get(loss_name, ()) if k not in keys]
    if missing:
        raise ValueError(
            f"loss {loss_name!r} needs loss_fn_inputs {list(REQUIRED_INPUTS[loss_name])}; "
            f"missing {missing}"
        )


def _config(
    config: Mapping[str, float], defaults: Mapping[str, float], loss: str
) -> dict[str, float]:
    unknown = set(config) - set(defaults)
    if unknown:
        raise ValueError(
            f"loss {loss!r} has no config key(s) {sorted(unknown)}; "
            f"it takes {sorted(defaults) or 'none'}"
        )
    return {**defaults, **config}


def _ratio_metrics(lp: Tensor, inputs: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
    q = inputs["logprobs"]
    log_ratio = (lp - q).detach()
    mask = inputs.get("mask")
    if mask is None:
        mask = (inputs["advantages"] != 0).to(lp.dtype)
    selected = mask > 0
    ratio = torch.exp(lp - q)
    metrics: dict[str, float] = {}
    if bool(selected.any()):
        weights = torch.exp(log_ratio[selected])
        diff = -log_ratio[selected]  # logp_rollout - logp_train
        metrics = {
            "importance_weight:max": float(weights.max()),
            "importance_weight:mean": float(weights.mean()),
            "mismatch_kl_k1:mean": float(diff.mean()),
            "mismatch_kl_k2:mean": float(0.5 * (diff**2).mean()),
            "tokens:sum": float(selected.sum()),
        }
    return ratio, metrics


def cross_entropy(
    lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> LossOutput:
    _config(config, {}, "cross_entropy")
    loss = -(lp * inputs["weights"]).sum()
    return LossOutput(loss, {"loss:sum": float(loss.detach())})


def importance_sampling(
    lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> LossOutput:
    _config(config, {}, "importance_sampling")
    ratio, metrics = _ratio_metrics(lp, inputs)
    loss = -(ratio * inputs["advantages"]).sum()
    return LossOutput(loss, {"loss:sum": float(loss.detach()), **metrics})


def ppo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossOutput:
    cfg = _config(config, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, "ppo")
    ratio, metrics = _ratio_metrics(lp, inputs)
    adv = inputs["advantages"]
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    unclipped_obj, clipped_obj = ratio * adv, clipped * adv
    loss = -torch.minimum(unclipped_obj, clipped_obj).sum()
    active = adv != 0
    clip_fraction = float(
        ((clipped_obj < unclipped_obj) & active).sum() / active.sum().clamp(min=1)
    )
    return LossOutput(
        loss, {"loss:sum": float(loss.detach()), "clip_fraction:mean": clip_fraction, **metrics}
    )


def cispo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossOutput:
    cfg = _config(config, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, "cispo")
    ratio, metrics = _ratio_metrics(lp, inputs)
    adv = inputs["advantages"]
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
    loss = -(clipped * lp * adv).sum()
    active = adv != 0
    clip_fraction = float(((ratio.detach() != clipped) & active).sum() / active.sum().clamp(min=1))
    return LossOutput(
        loss, {"loss:sum": float(loss.detach()), "clip_fraction:mean": clip_fraction, **metrics}
    )


def dro(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossOutput:
    if "beta" not in config:
        raise ValueError("loss 'dro' needs loss_fn_config {'beta': ...}")
    cfg = _config(config, {"beta": 0.0}, "dro")
    _, metrics = _ratio_metrics(lp, inputs)
    q, adv = inputs["logprobs"], inputs["advantages"]
    loss = -(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()
    return LossOutput(loss, {"loss:sum": float(loss.detach()), **metrics})


BUILTIN_LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}
