"""The "group_median" advantage estimator: each sample's reward against its group's median.

A median is a baseline that one outlying reward cannot drag the way it drags the mean. With
`normalize`, a group's advantages are divided by their mean absolute value, a robust counterpart
of GRPO's division by the standard deviation. Each of a sample's action tokens gets its advantage.
"""

from __future__ import annotations

import attrs
import numpy as np

from plait.api import AdvantageBatch

EPS = 1e-6


@attrs.frozen
class MedianOptions:
    normalize: bool = False
    """Divide each group's advantages by their mean absolute value (+ 1e-6)."""


def group_median(batch: AdvantageBatch, *, options: MedianOptions) -> list[list[np.ndarray]]:
    """Per group and sample, one advantage per action token."""
    result = []
    for rewards, tokens in zip(batch.rewards, batch.action_tokens, strict=True):
        advantages = rewards - np.median(rewards)
        if options.normalize:
            advantages = advantages / (np.abs(advantages).mean() + EPS)
        result.append([np.full(n, a) for a, n in zip(advantages, tokens, strict=True)])
    return result
