"""Group-relative advantage estimators (GRPO and relatives), registered as the `advantage`
components (`rl.advantage`). Each takes one group's rewards (samples of the same prompt) and gives
every sample its advantage; a group whose rewards are all equal gets zeros under every rule."""

from __future__ import annotations

import numpy as np

EPS = 1e-6


def grpo(rewards: np.ndarray) -> np.ndarray:
    """(r - mean) / (std + eps), DeepSeekMath's GRPO."""
    return (rewards - rewards.mean()) / (rewards.std() + EPS)


def dr_grpo(rewards: np.ndarray) -> np.ndarray:
    """r - mean: Dr. GRPO (no std scaling; also the tinker-cookbook default)."""
    return rewards - rewards.mean()


def rloo(rewards: np.ndarray) -> np.ndarray:
    """r - the mean of the *other* samples (REINFORCE leave-one-out)."""
    if rewards.size < 2:
        return np.zeros_like(rewards)
    return (rewards - rewards.mean()) * rewards.size / (rewards.size - 1)
