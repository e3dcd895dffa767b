"""Trajectories (what a rollout produced) and their conversion to training data.

Token-in-token-out: a trajectory keeps every prompt the sampler was given and every completion
exactly as the engine returned it (ids, logprobs, weight versions). Text is never re-tokenized.
Turns are merged into one datum while each turn's prompt extends the previous turn's
prompt + completion token for token; where that breaks, a new datum begins — never a silent merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs
import numpy as np

from plait.types import Datum, ModelInput, SampledSequence, TensorData

PromptSource = Literal["render", "bridge"]


@attrs.frozen
class Turn:
    """One model call: the prompt tokens given to the sampler and what it sampled."""

    prompt: tuple[int, ...] = attrs.field(converter=tuple[int, ...])
    completion: SampledSequence
    parse_ok: bool = True
    """False when the completion could not be parsed (malformed tool call, ...)."""
    prompt_source: PromptSource = "render"
    """How the prompt was made: rendered from messages, or bridged from the previous turn's ids."""
    role: str = ""
    """The environment's role that made this call ("" in an environment without roles)."""


@attrs.frozen
class Trajectory:
    """One episode of one task; `metrics` are its environment's own (e.g. env/reward/<name>)."""

    task: dict[str, Any]
    turns: tuple[Turn, ...] = attrs.field(converter=tuple[Turn, ...])
    rewards: tuple[float, ...] = attrs.field(converter=tuple[float, ...], factory=tuple)
    """The reward of every tool call that returned one, in order."""
    reward: float = 0.0
    """The rewards reduced by the configured rule."""
    correct: bool = False
    finished: bool = False
    truncated: bool = False
    error: str | None = None
    """Set when the environment failed; the trajectory then trains on nothing."""
    tool_errors: int = 0
    env_seconds: tuple[tuple[float, float], ...] = attrs.field(
        converter=tuple[tuple[float, float], ...], factory=tuple
    )
    """(start, end) wall-clock intervals of environment calls."""
    role_rewards: dict[str, float] = attrs.field(factory=dict)
    """Each role's reward (reduced like `reward`) in an episode whose environment names roles."""
    engine_retries: int = 0
    """Requests the inference engine failed and was sent again (`engine/retries`)."""
    metrics: dict[str, float] = attrs.field(factory=dict)

    def acting_roles(self) -> list[str]:
        """The roles that made a call, in order of their first call ([""] without roles)."""
        return list(dict.fromkeys(turn.role for turn in self.turns)) or [""]

    def for_role(self, role: str) -> Trajectory:
        """The episode as one role saw it: its own turns and rewards (correct: a reward >= 1)."""
        if not self.role_rewards:
            return self
        reward = self.role_rewards.get(role, 0.0)
        return attrs.evolve(
            self,
            turns=[t for t in self.turns if t.role == role],
            rewards=(reward,),
            reward=reward,
            correct=reward >= 1.0,
            role_rewards={},
        )

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def completion_tokens(self) -> int:
        return sum(len(t.completion.tokens) for t in self.turns)

    @property
    def prompt_tokens(self) -> int:
        return len(self.turns[0].prompt) if self.turns else 0

    @property
    def parse_errors(self) -> int:
        """Responses that could not be parsed (also counted in `tool_errors`)."""
        return sum(not turn.parse_ok for turn in self.turns)

    @property
    def bridged_turns(self) -> int:
        return sum(turn.prompt_source == "bridge" for turn in self.turns)


@attrs.define
class TokenSegments:
    """A merged token sequence with, per token, the sampler logprob and whether it was sampled."""

    tokens: list[int]
    logprobs: list[float]
    sampled: list[bool]
    versions: list[int]
    routing: TensorData | None = None
    """The experts that routed every token but the last (MoE samplers asked for them)."""


def merge_turns(turns: Sequence[Turn]) -> list[TokenSegments]:
    """Group consecutive turns whose prompts extend the previous sequence; one segment per group."""
    segments: list[TokenSegments] = []
    current: TokenSegments | None = None
    for turn in turns:
        prompt = list(turn.prompt)
        if current is not None and prompt[: len(current.tokens)] == current.tokens:
            tail = prompt[len(current.tokens) :]
        else:
            if current is not None:
                segments.append(current)
            current = TokenSegments([], [], [], [])
            tail = prompt
        current.tokens.extend(tail)
        current.logprobs.extend([0.0] * len(tail))
        current.sampled.extend([False] * len(tail))
        current.versions.extend([-1] * len(tail))
        completion = turn.completion
        current.tokens.extend(completion.tokens)
        current.logprobs.extend(completion.logprobs)
        current.sampled.extend([True] * len(completion.tokens))
        current.versions.extend(completion.versions())
        # A turn's routing covers its whole prompt (the engine ran it), so the last turn's wins.
        routing = completion.routed_experts
        current.routing = (
            routing if routing is not None and len(routing) == len(current.tokens) - 1 else None
        )
    if current is not None:
        segments.append(current)
    return segments


def segment_to_datum(segment: TokenSegments, advantage: float | Sequence[float]) -> Datum:
    """Next-token-aligned datum: input = tokens[:-1], targets = tokens[1:].

    Loss inputs: target_tokens, logprobs (the sampler's, 0 on prompt positions), advantages (on
    sampled positions only), mask (1 on sampled positions) and, when sampled, routed_experts.
    """
    tokens = np.asarray(segment.tokens, dtype=np.int64)
    sampled = np.asarray(segment.sampled[1:], dtype=np.float32)
    advantages = np.asarray(advantage, dtype=np.float32)
    advantages = (
        np.full(len(tokens) - 1, float(advantages), np.float32)
        if advantages.ndim == 0
        else advantages[1:]
    )
    inputs: dict[str, Any] = {
        "target_tokens": tokens[1:],
        "logprobs": np.asarray(segment.logprobs[1:], dtype=np.float32) * sampled,
        "advantages": advantages * sampled,
        "mask": sampled,
    }
    if segment.routing is not None:
        inputs["routed_experts"] = segment.routing
    return Datum(model_input=ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs=inputs)


def trajectory_to_datums(trajectory: Trajectory, advantage: float) -> list[Datum]:
    """Training data of one trajectory with one advantage for all its sampled tokens."""
    if trajectory.error is not None:
        return []
    return [
        segment_to_datum(seg, advantage)
        for seg in merge_turns(trajectory.turns)
        if len(seg.tokens) > 1
    ]
