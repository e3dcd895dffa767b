"""The built-in losses, with Tinker's input keys, defaults and token-sum reduction.

Notation: `lp` are the trainer's log-probabilities of the target tokens, `q = inputs["logprobs"]`
the sampler's, `A = inputs["advantages"]`, `r = exp(lp - q)`. Every loss is a *sum* over tokens
(normalise through the weights/advantages on the client side), and works on any shape: one datum
(N,) or a padded batch (B, T) whose padding positions have zero weight/advantage and lp = q = 0.

An optional `mask` input (1 on sampled tokens) is not part of any token-level formula; when
present, metrics such as the importance-weight max are taken over masked tokens only, and `gspo`
averages its sequence ratio over masked tokens (over non-zero advantages without a mask).

A sequence is one datum: the last axis. The step runner gives every datum a row of its own
(`plait_train.layout.MicroBatch`: packing and prefix sharing lay several datums into one row of
the *model's* input, but logprobs and loss inputs stay (datums, positions)), so a sequence-level
loss reduces each row of a (B, T) input, or the whole of an (N,) one, and gets the same result
for a datum alone, padded in a batch or packed with others.

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
    "gspo": ("target_tokens", "logprobs", "advantages"),
    "ppo_dual_clip": ("target_tokens", "logprobs", "advantages"),
    "value": ("target_tokens", "returns", "values", "weights"),
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


def _sampled(inputs: Mapping[str, Tensor]) -> Tensor:
    """The sampled tokens: the `mask` input when given, else the non-zero advantages."""
    mask = inputs.get("mask")
    return mask > 0 if mask is not None else inputs["advantages"] != 0


def _ratio_metrics(lp: Tensor, inputs: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, float]]:
    q = inputs["logprobs"]
    log_ratio = (lp - q).detach()
    selected = _sampled(inputs)
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


def _clipped(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """PPO's per-token objective min(r A, clip(r, low, high) A), and where the clip binds."""
    unclipped, clipped = ratio * adv, torch.clamp(ratio, low, high) * adv
    return torch.minimum(unclipped, clipped), clipped < unclipped


def _fraction(where: Tensor, adv: Tensor) -> float:
    """The fraction of the loss's tokens (non-zero advantages) where `where` holds."""
    active = adv != 0
    return float((where & active).sum() / active.sum().clamp(min=1))


def ppo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossOutput:
    """-sum min(r A, clip(r, clip_low_threshold, clip_high_threshold) A).

    DAPO's asymmetric "clip-higher" (Yu et al. 2025) is this loss with clip_low_threshold=0.8,
    clip_high_threshold=1.28."""
    cfg = _config(config, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, "ppo")
    ratio, metrics = _ratio_metrics(lp, inputs)
    adv = inputs["advantages"]
    objective, clipped = _clipped(ratio, adv, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    loss = -objective.sum()
    return LossOutput(
        loss,
        {
            "loss:sum": float(loss.detach()),
            "clip_fraction:mean": _fraction(clipped, adv),
            **metrics,
        },
    )


def ppo_dual_clip(
    lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> LossOutput:
    """Dual-clip PPO (Ye et al. 2020; verl's clip_ratio_c): `ppo`'s objective, and on tokens with
    A < 0 at least c A (c = dual_clip): -sum where(A < 0, max(min(r A, clip(r) A), c A),
    min(r A, clip(r) A)). With A < 0 PPO's objective falls without bound as r grows (a token the
    sampler found unlikely, now likely); the dual clip bounds it, and its gradient, at r > c."""
    cfg = _config(
        config,
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "dual_clip": 3.0},
        "ppo_dual_clip",
    )
    if not cfg["dual_clip"] > 1.0:
        raise ValueError(
            f"loss 'ppo_dual_clip' needs loss_fn_config['dual_clip'] > 1 (the bound c on the "
            f"ratio of negative-advantage tokens; default 3.0), got {cfg['dual_clip']}"
        )
    ratio, metrics = _ratio_metrics(lp, inputs)
    adv = inputs["advantages"]
    objective, clipped = _clipped(ratio, adv, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    floor = cfg["dual_clip"] * adv
    negative = adv < 0
    loss = -torch.where(negative, torch.maximum(objective, floor), objective).sum()
    return LossOutput(
        loss,
        {
            "loss:sum": float(loss.detach()),
            "clip_fraction:mean": _fraction(clipped, adv),
            "dual_clip_fraction:mean": _fraction(negative & (objective < floor), adv),
            **metrics,
        },
    )


def gspo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossOutput:
    """GSPO (Zheng et al. 2025), in its GSPO-token form: -sum min(s A, clip(s, 1 - clip_low,
    1 + clip_high) A), where on every token of a sequence (a row, see the module docstring)
    s_t = sg(s) * exp(lp_t - sg(lp_t)) and s = exp(mean of lp - q over the sequence's sampled
    tokens). Its value is the sequence ratio s, so the clip is decided per sequence; its
    gradient is s times that of lp_t, so per-token advantages work. Normalise through the
    advantages (A / |y| for the paper's per-sequence token mean)."""
    cfg = _config(config, {"clip_low": 3e-4, "clip_high": 4e-4}, "gspo")
    _, metrics = _ratio_metrics(lp, inputs)
    q, adv = inputs["logprobs"], inputs["advantages"]
    sampled = _sampled(inputs).to(lp.dtype)
    log_s = ((lp - q).detach() * sampled).sum(-1, keepdim=True) / sampled.sum(
        -1, keepdim=True
    ).clamp(min=1)
    ratio = torch.exp(log_s) * torch.exp(lp - lp.detach())
    objective, clipped = _clipped(ratio, adv, 1.0 - cfg["clip_low"], 1.0 + cfg["clip_high"])
    loss = -objective.sum()
    return LossOutput(
        loss,
        {
            "loss:sum": float(loss.detach()),
            "clip_fraction:mean": _fraction(clipped, adv),
            **metrics,
        },
    )


def cispo(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossOutput:
    cfg = _config(config, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, "cispo")
    ratio, metrics = _ratio_metrics(lp, inputs)
    adv = inputs["advantages"]
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"]).detach()
    loss = -(clipped * lp * adv).sum()
    return LossOutput(
        loss,
        {
            "loss:sum": float(loss.detach()),
            "clip_fraction:mean": _fraction(ratio.detach() != clipped, adv),
            **metrics,
        },
    )


def dro(lp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossOutput:
    if "beta" not in config:
        raise ValueError("loss 'dro' needs loss_fn_config {'beta': ...}")
    cfg = _config(config, {"beta": 0.0}, "dro")
    _, metrics = _ratio_metrics(lp, inputs)
    q, adv = inputs["logprobs"], inputs["advantages"]
    loss = -(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2).sum()
    return LossOutput(loss, {"loss:sum": float(loss.detach()), **metrics})


def value(v: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> LossOutput:
    """A critic's clipped value loss (PPO; verl's cliprange_value): `v` is the value model's
    output at each position (where a policy gives logprobs), R = inputs["returns"] the targets,
    V_old = inputs["values"] its values when the batch was prepared, w = inputs["weights"]:
    sum 0.5 w max((v - R)^2, (V_old + clip(v - V_old, -c, c) - R)^2) with c = value_clip: where
    a value has moved more than c from its old one (in a later update on the same batch) and its
    clipped value is the further from R, the loss is the clipped value's, whose gradient is 0;
    value_clip = 0: the plain squared error."""
    cfg = _config(config, {"value_clip": 0.5}, "value")
    returns, old, weights = inputs["returns"], inputs["values"], inputs["weights"]
    error = (v - returns) ** 2
    metrics: dict[str, float] = {}
    if cfg["value_clip"] > 0:
        clip = cfg["value_clip"]
        clipped_error = (old + torch.clamp(v - old, -clip, clip) - returns) ** 2
        metrics["value_clip_fraction:mean"] = _fraction(clipped_error > error, weights)
        error = torch.maximum(error, clipped_error)
    loss = 0.5 * (error * weights).sum()
    return LossOutput(loss, {"loss:sum": float(loss.detach()), **metrics})


def kl_k1(lp: Tensor, ref: Tensor) -> Tensor:
    """Schulman's k1 estimate of KL(pi || ref) per token: log_ratio = lp - ref (unbiased, can be
    negative). Gradient with respect to lp: 1."""
    return lp - ref


def kl_k2(lp: Tensor, ref: Tensor) -> Tensor:
    """Schulman's k2 estimate per token: 0.5 * (lp - ref)^2 (biased, low variance, >= 0).
    Gradient with respect to lp: lp - ref."""
    return 0.5 * (lp - ref) ** 2


def kl_k3(lp: Tensor, ref: Tensor) -> Tensor:
    """Schulman's k3 estimate per token (verl's "low_var_kl", unclamped): r - 1 - log r with
    r = exp(ref - lp) (unbiased, >= 0). Gradient with respect to lp: 1 - exp(ref - lp)."""
    log_r = ref - lp
    return torch.exp(log_r) - 1 - log_r


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}
"""Per-token estimators of KL(pi || ref) from the sampled tokens' logprobs (Schulman,
"Approximating KL divergence"), by name: the step runner's `kl_estimator`."""


BUILTIN_LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "ppo_dual_clip": ppo_dual_clip,
    "value": value,
}
