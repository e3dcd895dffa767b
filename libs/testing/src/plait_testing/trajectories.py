"""Trajectories written out by hand, for tests of how trajectories become training data."""

from __future__ import annotations

from collections.abc import Sequence

from plait.api import SampledSequence, StopReason, Trajectory, Turn


def turn(prompt: Sequence[int], completion: Sequence[int], stop: StopReason = "stop") -> Turn:
    """A turn whose completion's every token has the sampler logprob -0.5."""
    return Turn(list(prompt), SampledSequence(list(completion), [-0.5] * len(completion), stop))


def episode(
    reward: float,
    lengths: Sequence[int],
    *,
    stop: StopReason = "stop",
    error: str | None = None,
    offset: int = 0,
) -> Trajectory:
    """One turn per entry of `lengths`, each a response of that many tokens, the last re-rendered
    (a datum of its own) when there are several; `stop` is the last response's stop reason."""
    turns, prompt = [], [1, 2]
    for index, n in enumerate(lengths):
        completion = [10 + offset + (index + k) % 5 for k in range(n)]
        last = index == len(lengths) - 1
        turns.append(turn(prompt, completion, stop if last else "stop"))
        prompt = [1, 3] if index == len(lengths) - 2 else [*prompt, *completion, 9]
    return Trajectory(task={}, turns=turns, reward=reward, error=error)
