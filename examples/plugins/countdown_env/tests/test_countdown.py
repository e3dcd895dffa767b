"""The SDK's environment contract kit on the countdown environment (in-process and over ORS HTTP),
its registration through the hook, and the verifier."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from plait.api import ConfigError, ToolOutput, build
from plait_countdown_env.env import Countdown, CountdownOptions, make_task
from plait_sdk.testing import check_sdk_environment

SRC = Path(__file__).resolve().parents[1] / "src"


def solve(task: Mapping[str, Any]) -> Sequence[tuple[str, Mapping[str, Any]]]:
    return [("answer", {"text": f"Let me think.\n{task['solution']} = {task['target']}"})]


def test_passes_the_sdk_contract_kit_and_every_solution_earns_the_reward() -> None:
    env = build("env", "countdown", options={"train_size": 20, "test_size": 5})
    report = check_sdk_environment(env.env_cls, reward_range=(0.0, 1.0), solve=solve)
    assert report.in_process.episodes >= 1 and set(report.in_process.rewards) == {1.0}
    assert report.over_http is not None and set(report.over_http.rewards) == {1.0}
    assert report.setups == report.teardowns


def test_registers_through_the_hook_lazily() -> None:
    probe = (
        "import json, sys; from plait.plugins import get_registry; "
        "f = get_registry().get('env', 'countdown'); "
        "print(json.dumps([f.plugin, f.target, 'plait_countdown_env.env' in sys.modules]))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(SRC),
        "PLAIT_PLUGINS": "none",
        "PLAIT_PLUGIN_MODULES": "plait_countdown_env.plugin",
    }
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [
        "plait_countdown_env.plugin",
        "plait_countdown_env.env:make_env",
        False,
    ]


def test_options_are_validated_and_bound() -> None:
    with pytest.raises(
        ConfigError, match=r'env\.options\.number: unknown key \(did you mean "numbers"\?\)'
    ):
        build("env", "countdown", options={"number": 3}, options_path="env.options")
    with pytest.raises(ConfigError, match="numbers"):
        build("env", "countdown", options={"numbers": 9})
    env = build("env", "countdown", options={"numbers": 3, "test_size": 7, "seed": 5})
    assert env.name == "countdown" and asyncio.run(env.num_tasks("test")) == 7
    task = asyncio.run(env.get_task("test", 3))
    assert len(task["numbers"]) == 3 and task == make_task(
        CountdownOptions(numbers=3, test_size=7, seed=5), "test", 3
    )


@pytest.mark.parametrize("index", range(200))
def test_every_task_is_solvable_by_its_solution(index: int) -> None:
    task = make_task(CountdownOptions(), "train", index)
    assert task["target"] > 0 and all(1 <= n <= 20 for n in task["numbers"])
    assert reply(task, task["solution"]).reward == 1.0


def reply(task: Mapping[str, Any], text: str) -> ToolOutput:
    async def episode() -> ToolOutput:
        from plait_sdk import LocalEnvironment

        session = await LocalEnvironment(Countdown).open(task)
        try:
            return await session.call("answer", {"text": text})
        finally:
            await session.close()

    return asyncio.run(episode())


@pytest.mark.parametrize(
    ("text", "reward", "feedback"),
    [
        ("(6 + 4) * 2", 1.0, "Correct"),
        (
            "I get:\n`6 * 2 + 4 * 2` = 20",
            1.0,
            "Correct",
        ),  # the last line, without "= 20" and backticks
        ("6 * 4 - 2", 0.0, "Wrong: 6 * 4 - 2 = 22, not 20"),
        ("6 * 6", 0.0, "not given (or one twice)"),
        ("10 + 10", 0.0, "not given"),
        ("2 ** 4", 0.0, "only whole numbers"),
        ("6 + 4 + 4", 0.0, "not given (or one twice)"),
        ("6 / (2 - 2)", 0.0, "division by zero"),
        ("6 / (4 - 2 * 2)", 0.0, "division by zero"),
        ("__import__('os')", 0.0, "only whole numbers"),
        ("6 +", 0.0, "is not an arithmetic expression"),
        ("", 0.0, "is not an arithmetic expression"),
    ],
)
def test_the_verifier(text: str, reward: float, feedback: str) -> None:
    out = reply({"numbers": [6, 4, 2, 2], "target": 20}, text)
    assert out.reward == reward and out.finished
    assert feedback in out.blocks[0].text
