"""Roles: several parties in one episode (proposer and solver, two players), an ORS extension.

An environment with roles says who acts and what each earned through two keys plain ORS
clients pass over (they never break on unknown task keys or tool-output metadata):

- the task's `"plait.role"` names the role that acts first;
- a tool output whose metadata has `"plait.role"` hands the turn to that role, which is told the
  output's blocks as a user message (its own conversation; each role sees only what it is told);
- `"plait.rewards"` in a tool output's metadata gives each role's reward for that call. The
  output's own `reward` stays what a plain client sees: the episode's.

plait's controller routes each role's turns to the policy that plays it (`[policies.NAME] roles`)
and trains each policy on its roles' own turns and rewards; one policy may play every role
(self-play). A plain ORS client plays every role with one model: the hand-over reaches it as the
tool's result. These helpers build the outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plait.api import REWARDS_KEY, ROLE_KEY, TextBlock, ToolOutput


def first_role(task: Mapping[str, Any], role: str) -> dict[str, Any]:
    """`task` with `role` acting first."""
    return {**task, ROLE_KEY: role}


def hand_over(
    role: str,
    text: str,
    *,
    rewards: Mapping[str, float] | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> ToolOutput:
    """Give the turn to `role`, telling it `text`; optionally with rewards for the roles so far."""
    extra = {REWARDS_KEY: dict(rewards)} if rewards is not None else {}
    return ToolOutput(
        blocks=[TextBlock(text)], metadata={**(metadata or {}), ROLE_KEY: role, **extra}
    )


def finish(
    text: str, rewards: Mapping[str, float], *, metadata: Mapping[str, Any] | None = None
) -> ToolOutput:
    """End the episode with each role's reward; a plain client sees their mean as the reward."""
    return ToolOutput(
        blocks=[TextBlock(text)],
        reward=sum(rewards.values()) / max(len(rewards), 1),
        finished=True,
        metadata={**(metadata or {}), REWARDS_KEY: dict(rewards)},
    )
