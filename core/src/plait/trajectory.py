"""Trajectories: what a rollout produced.

Token-in-token-out: a trajectory keeps every prompt the sampler was given and every completion
exactly as the engine returned it (ids, logprobs, weight versions). Text is never re-tokenized;
`plait_algorithms.datums` makes training data of it.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from plait.types import SampledSequence

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
    ref_logprobs: tuple[float, ...] | None = None
    """The reference policy's logprob of each completion token (`rl.kl.reference = "inference"`)."""


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
