"""Gymnasium adapters both ways, with real gymnasium environments."""

from __future__ import annotations

import json

import gymnasium
import pytest

from plait.api import ToolError, ToolOutput
from plait_sdk import Environment, LocalEnvironment, Split, TextBlock, terminal, tool
from plait_sdk.gym import GymnasiumEnvironment, PlaitGymEnv, parse_action
from plait_testing.environment import run_environment_contract


class Riddle(Environment):
    @classmethod
    def list_splits(cls) -> list[Split]:
        return [Split("train")]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict]:
        return [{"q": "What has keys but no locks?", "a": "piano"}, {"q": "2+2?", "a": "4"}]

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(self.task_spec["q"])]

    @tool
    def hint(self) -> ToolOutput:
        return ToolOutput(blocks=[TextBlock(f"starts with {self.task_spec['a'][0]}")], reward=-0.1)

    @terminal
    def answer(self, text: str) -> ToolOutput:
        right = self.task_spec["a"] in text.lower()
        return ToolOutput(
            blocks=[TextBlock("right" if right else "wrong")], reward=float(right), finished=True
        )


def test_plait_environment_as_gymnasium_env() -> None:
    env = PlaitGymEnv(LocalEnvironment(Riddle), max_steps=3, render_mode="ansi")
    try:
        obs, info = env.reset(seed=0, options={"index": 0})
        assert obs == "What has keys but no locks?" and info["index"] == 0
        assert [t.name for t in info["tools"]] == ["hint"] and info[
            "terminal_tool"
        ].name == "answer"
        assert env.observation_space.contains(obs)
        obs, reward, terminated, truncated, _ = env.step({"name": "hint", "input": {}})
        assert (obs, reward, terminated, truncated) == ("starts with p", -0.1, False, False)
        assert env.render() == "starts with p"
        obs, reward, terminated, truncated, _ = env.step(json.dumps({"name": "nope", "input": {}}))
        assert obs.startswith("error:") and reward == 0.0 and not terminated
        obs, reward, terminated, truncated, _ = env.step(
            "A piano!"
        )  # plain text goes to the terminal tool
        assert (obs, reward, terminated, truncated) == ("right", 1.0, True, False)

        env.reset(options={"index": 1})
        results = [env.step({"name": "hint", "input": {}}) for _ in range(3)]
        assert [r[3] for r in results] == [False, False, True]  # truncated by the step budget
        assert not any(r[2] for r in results)
        with pytest.raises(RuntimeError, match="reset"):
            env.step("4")
        first, _ = env.reset(seed=123)
        again, _ = env.reset(seed=123)
        assert first == again  # the seed picks the task reproducibly
    finally:
        env.close()


def test_gymnasium_text_env_as_plait_environment() -> None:
    env = GymnasiumEnvironment(
        lambda: gymnasium.make("FrozenLake-v1", is_slippery=False, render_mode="ansi"),
        name="frozenlake",
        splits={"train": [0, 1, 2]},
        instructions="Reach G. Actions: 0 left, 1 down, 2 right, 3 up.",
    )

    async def solve_first_task() -> list:
        import asyncio

        session = await env.open(await env.get_task("train", 0))
        prompt = (await session.prompt())[0].text
        results = [await session.call("act", {"action": a}) for a in ("1", "1", "2", "2", "1", "2")]
        results.append(await session.call("act", {"action": "2"}))
        bad = await session.call("act", {"action": "7"})
        await session.close()
        await asyncio.sleep(0)
        return [prompt, results, bad]

    import asyncio

    prompt, results, bad = asyncio.run(solve_first_task())
    assert prompt == "Reach G. Actions: 0 left, 1 down, 2 right, 3 up.\n\n[S]FFF\nFHFH\nFFFH\nHFFG"
    assert all(isinstance(r, ToolOutput) for r in results[:6])
    assert [r.reward for r in results[:6]] == [0.0] * 5 + [1.0]
    assert results[5].text.endswith("  (Right)\nSFFF\nFHFH\nFFFH\nHFF[G]")
    assert (
        results[5].finished
        and results[5].metadata["terminated"]
        and not results[5].metadata["truncated"]
    )
    assert isinstance(results[6], ToolError) and results[6].reason == "episode_finished"
    assert isinstance(bad, ToolError) and bad.reason == "episode_finished"
    report = run_environment_contract(
        env, reward_range=(0.0, 1.0), solve=lambda task: [("act", {"action": a}) for a in "112212"]
    )
    assert report.episodes_finished == 3


def test_text_actions_are_checked_against_the_action_space() -> None:
    space = gymnasium.spaces.Discrete(4)
    assert parse_action(space, " 2 ") == 2
    with pytest.raises(ValueError, match="not in the action space"):
        parse_action(space, "9")
    box = gymnasium.spaces.Box(0.0, 1.0, shape=(2,))
    assert parse_action(box, "[0.5, 0.25]").tolist() == [0.5, 0.25]
