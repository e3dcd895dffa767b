"""KL to the reference policy in the reward (`rl.kl.where = "reward"`, verl's use_kl_in_reward).

Before the advantages, each sample's reward loses `rl.kl.coef` x the sum over its action tokens of
the per-token estimate of KL(policy || reference) (`rl.kl.estimator`). The policy's trainer
computes the estimates in one forward pass with its reference (its `kl_ref` output; plait-torch
keeps the initial weights with trainer.options.reference = true). The estimate is summed, not
spread over the tokens: every estimator here sees one reward per sample.

Reported: `policy/kl_ref` (the mean estimate per action token, as the trainer reports it with KL
in the loss) and `data/kl_reward_penalty` (the mean penalty per sample).
"""

from __future__ import annotations

import numpy as np

from plait.api import RLSection, TrainerEngine
from plait_algorithms.datums import Samples, forward_on_action_tokens

KL_REF = "kl_ref"
"""The trainer's forward output of per-token KL estimates (plait_train.step.KL_REF)."""


def kl_penalties(
    reference: TrainerEngine, rl: RLSection, samples: Samples
) -> tuple[list[np.ndarray], dict[str, float]]:
    """Per group, each sample's penalty, coef x its summed KL estimate; and the metrics."""
    per_token = forward_on_action_tokens(
        reference,
        samples,
        KL_REF,
        rl.loss,
        {**rl.loss_config, **rl.kl.penalty_keys()},
        rl.micro_batch_size,
        missing=(
            "rl.kl.where = 'reward'",
            "use a trainer engine that keeps a reference and outputs the KL to it (plait-torch "
            "with trainer.options.reference = true), or set rl.kl.where = 'loss'",
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
