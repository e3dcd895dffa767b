"""Group-relative advantages (GRPO and relatives). Pure numpy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

AdvantageKind = Literal["grpo", "dr_grpo", "rloo"]


def group_advantages(
    rewards: Sequence[float], kind: AdvantageKind = "grpo", eps: float = 1e-6
) -> np.ndarray:
    """Advantages of one group of samples of the same prompt.

    - grpo: (r - mean) / (std + eps)   (DeepSeekMath)
    - dr_grpo: r - mean                (Dr. GRPO; also the tinker-cookbook default)
    - rloo: r - mean of the *other* samples (leave-one-out baseline)
    A group whose rewards are all equal gets zero advantages under every rule.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return r
    centered = r - r.mean()
    if kind == "grpo":
        return centered / (r.std() + eps)
    if kind == "dr_grpo":
        return centered
    if kind == "rloo":
        if r.size == 1:
            return np.zeros_like(r)
        return centered * r.size / (r.size - 1)
    raise ValueError(f"unknown advantage kind {kind!r}; expected grpo, dr_grpo or rloo")


def is_constant(rewards: Sequence[float]) -> bool:
    """True when every sample of a group got the same reward (no learning signal)."""
    return len(rewards) == 0 or float(np.ptp(np.asarray(rewards, dtype=np.float64))) == 0.0
