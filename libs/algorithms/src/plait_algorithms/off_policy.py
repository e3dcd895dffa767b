"""Off-policy corrections, registered as the `off_policy_correction` components
(`off_policy.correction`): importance weights of sampled tokens, truncated and masked.

w = pi_train / pi_rollout per sampled token (or per sequence: the product over its tokens), with
pi_train the trainer's probability at the weights about to be updated and pi_rollout the
sampler's. Advantages are multiplied by min(w, truncate) (truncated IS); tokens (sequences) whose
w falls outside [mask_below, mask_above] are left out of the loss; and the loss's own ratio is
taken against pi_train from then on (decoupled PPO / TIS). Options: `plait.api.OffPolicySection`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plait.api import (
    OFF_POLICY_CORRECTION,
    ConfigError,
    Datum,
    OffPolicySection,
    RunConfig,
    TrainerEngine,
    get_registry,
)
from plait_algorithms.datums import forward_outputs

_MAX_LOG_WEIGHT = 80.0  # far above any useful bound, below float64 overflow of exp()


def corrected(
    config: RunConfig, trainer: TrainerEngine | None, datums: list[Datum]
) -> tuple[list[Datum], dict[str, float]]:
    """`datums` corrected as `off_policy.correction` says (as they are with "none"), with the
    trainer's logprobs from one forward pass at the weights about to be updated; its metrics."""
    rl, correction = config.rl, config.off_policy.correction
    if correction == "none" or not datums:
        return datums, {}
    if trainer is None:
        raise ConfigError(
            "off_policy.correction",
            "an off-policy correction needs the policy's trainer, and the batch preparer got none",
            fix="pass the policy's trainer to prepare(), as the run loop does",
        )
    train_logprobs = forward_outputs(
        trainer,
        datums,
        "logprobs",
        rl.loss,
        rl.loss_config,
        rl.micro_batch_size,
        missing=("off_policy.correction", "use a trainer engine whose forward gives logprobs"),
    )
    correct = get_registry().get(OFF_POLICY_CORRECTION, correction).load()
    return correct(datums, train_logprobs, config.off_policy)


def token(
    datums: Sequence[Datum], train_logprobs: Sequence[np.ndarray], options: OffPolicySection
) -> tuple[list[Datum], dict[str, float]]:
    """A weight per sampled token."""
    return importance_correction(datums, train_logprobs, options, per_sequence=False)


def sequence(
    datums: Sequence[Datum], train_logprobs: Sequence[np.ndarray], options: OffPolicySection
) -> tuple[list[Datum], dict[str, float]]:
    """One weight per sequence: the product of its tokens' weights."""
    return importance_correction(datums, train_logprobs, options, per_sequence=True)


def importance_correction(
    datums: Sequence[Datum],
    train_logprobs: Sequence[np.ndarray],
    options: OffPolicySection,
    *,
    per_sequence: bool,
) -> tuple[list[Datum], dict[str, float]]:
    """`datums` corrected with the trainer's logprobs (one array per datum, aligned with its
    loss_fn_inputs), and the `policy/importance_weight_*`, `policy/mismatch_kl` and
    `policy/is_*` metrics over their sampled tokens."""
    corrected: list[Datum] = []
    raw, applied, masked, rollout_lp, train_lp = [], [], [], [], []
    for datum, lp in zip(datums, train_logprobs, strict=True):
        inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
        lp = np.asarray(lp, dtype=np.float64)
        sampled = inputs["mask"] > 0
        log_w = np.where(sampled, lp - inputs["logprobs"], 0.0)
        if per_sequence:
            log_w = np.where(sampled, log_w[sampled].sum(), 0.0)
        w = np.exp(np.minimum(log_w, _MAX_LOG_WEIGHT))
        drop = np.zeros_like(sampled)
        if options.mask_below:
            drop |= sampled & (w < options.mask_below)
        if options.mask_above:
            drop |= sampled & (w > options.mask_above)
        weight = np.minimum(w, options.truncate) if options.truncate else w
        weight = np.where(drop, 0.0, weight)
        raw.append(w[sampled])
        applied.append(weight[sampled & ~drop])
        masked.append(drop[sampled])
        rollout_lp.append(inputs["logprobs"][sampled])
        train_lp.append(lp[sampled])
        inputs["advantages"] = inputs["advantages"] * weight
        inputs["logprobs"] = np.where(sampled, lp, 0.0)
        inputs["mask"] = (sampled & ~drop).astype(np.float32)
        corrected.append(Datum(datum.model_input, inputs))
    w_all = np.concatenate(raw) if raw else np.zeros(0)
    if not w_all.size:
        return corrected, {}
    applied_all, masked_all = np.concatenate(applied), np.concatenate(masked)
    diff = np.concatenate(rollout_lp) - np.concatenate(train_lp)
    return corrected, {
        "policy/importance_weight_max": float(w_all.max()),
        "policy/importance_weight_mean": float(w_all.mean()),
        "policy/mismatch_kl": float(diff.mean()),
        "policy/mismatch_kl_k2": float(0.5 * (diff**2).mean()),
        "policy/is_weight_applied_max": float(applied_all.max()) if applied_all.size else 0.0,
        "policy/is_truncated_fraction": float((w_all > options.truncate).mean())
        if options.truncate
        else 0.0,
        "policy/is_masked_fraction": float(masked_all.mean()),
    }
