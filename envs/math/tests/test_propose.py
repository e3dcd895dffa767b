"""math.propose: the proposer's answer hands the turn to the solver, and the solver's answer ends
the episode with both roles' rewards (plait_sdk.roles, seen through the core protocol)."""

from __future__ import annotations

import asyncio
from typing import Any

from plait.api import REWARDS_KEY, ROLE_KEY, ToolOutput, build


def episode(*answers: str, index: int = 7) -> tuple[dict[str, Any], list[ToolOutput]]:
    async def run() -> tuple[dict[str, Any], list[ToolOutput]]:
        env = build("env", "math.propose", options={}, options_path="env.options")
        task = await env.get_task("train", index)
        session = await env.open(task)
        try:
            terminal = await session.terminal_tool()
            assert terminal is not None and [m.content for m in await session.messages()] == [
                f"Write two digits that add up to {task['target']}."
            ]
            return task, [await session.call(terminal.name, {"text": a}) for a in answers]
        finally:
            await session.close()

    return asyncio.run(run())


def test_the_proposer_acts_first_and_hands_a_well_formed_problem_to_the_solver() -> None:
    task, (proposed, solved) = episode("3 + 4", "7")
    assert task[ROLE_KEY] == "proposer" and task["target"] == 7
    assert (
        proposed.metadata == {ROLE_KEY: "solver"}
        and proposed.text == "3 + 4 ="
        and not proposed.finished
    )
    assert solved.finished and solved.metadata[REWARDS_KEY] == {"proposer": 1.0, "solver": 1.0}
    assert solved.reward == 1.0 and solved.metadata["correct"]


def test_the_proposer_earns_only_what_the_solver_solves_on_target() -> None:
    (_, (_, wrong)) = episode(
        "3 + 4", "7 is the sum."
    )  # the solver's answer must be the bare number
    assert wrong.metadata[REWARDS_KEY] == {"proposer": 0.0, "solver": 0.0}
    (_, (_, off_target)) = episode("2 + 2", "4")  # solved, but not a sum for 7
    assert (
        off_target.metadata[REWARDS_KEY] == {"proposer": 0.0, "solver": 1.0}
        and off_target.reward == 0.5
    )


def test_a_malformed_problem_ends_the_episode_before_the_solver_acts() -> None:
    (_, (ended,)) = episode("3 + 4 makes 7.")
    assert ended.finished and ROLE_KEY not in ended.metadata
    assert ended.metadata[REWARDS_KEY] == {"proposer": 0.0}
