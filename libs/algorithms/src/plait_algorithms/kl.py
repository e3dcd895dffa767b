"""KL to the reference policy in the reward (`rl.kl.where = "reward"`, verl's use_kl_in_reward).

Before the advantages, each sample's reward loses `rl.kl.coef` x the sum over its action tokens of
the per-token estimate of KL(policy || reference) (`rl.kl.estimator`). Where the reference is the
trainer's (`rl.kl.reference = "trainer"`), the policy's trainer computes the estimates in one
forward pass with its reference (its `kl_ref` output; plait-torch keeps the initial weights with
trainer.options.reference = true). Where it is a frozen inference engine's (`"inference"`), the
episodes came with the reference's logprobs, and the estimates are taken here against the
sampler's logprobs: no forward pass at all. The estimate is summed, not spread over the tokens:
every estimator here sees one reward per sample.

Reported: `policy/kl_ref` (the mean estimate per action token, as the trainer reports it with KL
in the loss) and `data/kl_reward_penalty` (the mean penalty per sample).
"""

from __future__ import annotations

import numpy as np

from plait.api import ConfigError, RLSection, TrainerEngine
from plait_algorithms.datums import (
    REF_LOGPROBS,
    Samples,
    forward_on_action_tokens,
    on_samples_action_tokens,
)

KL_REF = "kl_ref"
"""The trainer's forward output of per-token KL estimates (plait_train.step.KL_REF)."""


def kl_penalties(
    trainer: TrainerEngine | None, rl: RLSection, samples: Samples
) -> tuple[list[np.ndarray], dict[str, float]]:
    """Per group, each sample's penalty, coef x its summed KL estimate; and the metrics."""
    if rl.kl.reference == "inference":
        per_token = sampled_estimates(rl.kl.estimator, samples)
    elif trainer is None:
        raise ConfigError(
            "rl.kl.where",
            "KL in the reward with rl.kl.reference = 'trainer' needs the policy's trainer, and "
            "the batch preparer got none",
            fix="pass the policy's trainer to prepare(), as the run loop does",
        )
    else:
        per_token = forward_on_action_tokens(
            trainer,
            samples,
            KL_REF,
            rl.loss,
            {**rl.loss_config, **rl.kl.penalty_keys()},
            rl.micro_batch_size,
            missing=(
                "rl.kl.where = 'reward'",
                "use a trainer engine that keeps a reference and outputs the KL to it "
                "(plait-torch with trainer.options.reference = true), or set "
                "rl.kl.reference = 'inference'",
            ),
        )
    penalties = [np.asarray([rl.kl.coef * kl.sum() for kl in group]) for group in per_token]
    estimates = [kl for group in per_token for kl in group]
    tokens = sum(kl.size for kl in estimates)
    metrics = {
        "policy/kl_ref": float(sum(kl.sum() for kl in estimates) / max(tokens, 1)),
        "data/kl_reward_penalty": float(np.mean(np.concatenate(penalties))) if penalties else 0.0,
    }
    return penalties, metrics


def sampled_estimates(estimator: str, samples: Samples) -> list[list[np.ndarray]]:
    """Per group and sample, the KL estimate at each action token from its datums' sampler and
    reference logprobs."""
    flat = [datum for group in samples for sample in group for datum in sample]
    inputs = [d.loss_fn_inputs for d in flat]
    per_datum = [
        estimate(i["logprobs"].to_numpy(), i[REF_LOGPROBS].to_numpy(), estimator) for i in inputs
    ]
    return on_samples_action_tokens(samples, per_datum)


def estimate(logprobs: np.ndarray, ref_logprobs: np.ndarray, estimator: str) -> np.ndarray:
    """Schulman's estimate of KL(pi || ref) per token (as `plait_train.losses.KL_ESTIMATORS`):
    k1 = log r, k2 = (log r)^2 / 2, k3 = 1/r - 1 + log r, with log r = logprobs - ref_logprobs."""
    log_ratio = logprobs.astype(np.float64) - ref_logprobs.astype(np.float64)
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return np.expm1(-log_ratio) + log_ratio
