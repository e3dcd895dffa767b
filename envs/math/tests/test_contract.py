"""The SDK's environment contract kit on every math environment, in-process and over ORS HTTP,
each episode played to the end with the right answer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

from plait.api import build
from plait_sdk.testing import check_sdk_environment

Action = tuple[str, Mapping[str, Any]]


def formatted(task: Mapping[str, Any]) -> str:
    answer = task["answer"]
    return {
        "plain": answer,
        "last_number": f"It is {answer}",
        "boxed": f"\\boxed{{{answer}}}",
        "answer_tag": f"<answer>{answer}</answer>",
        "hash": f"#### {answer}",
    }[task["answer_format"]]


def answer_in_text(task: Mapping[str, Any]) -> Sequence[Action]:
    return [("final_answer", {"text": formatted(task)})]


def calculate_then_answer(task: Mapping[str, Any]) -> Sequence[Action]:
    return [
        ("calculator", {"expression": task["expression"]}),
        ("calculator", {"expression": "1 / 0"}),
        ("answer", {"answer": task["answer"]}),
    ]


@pytest.mark.parametrize(
    ("name", "options", "solve"),
    [
        ("math.arith", {"preset": "tiny"}, answer_in_text),
        ("math.arith", {"preset": "hard", "answer_format": "boxed"}, answer_in_text),
        ("math.gsm8k", {"train_size": 20}, answer_in_text),
        ("math.calculator", {}, calculate_then_answer),
        ("math.calculator", {}, answer_in_text),
    ],
)
def test_math_envs_pass_the_sdk_contract_kit(
    name: str,
    options: dict[str, Any],
    solve: Callable[[Mapping[str, Any]], Sequence[Action]],
) -> None:
    env = build("env", name, options=options)
    report = check_sdk_environment(env.env_cls, reward_range=(0.0, 1.0), solve=solve)
    assert report.episodes >= 2  # in-process and over HTTP
    assert report.in_process.rewards and set(report.in_process.rewards) == {1.0}
    assert report.over_http is not None and set(report.over_http.rewards) == {1.0}
    assert report.setups == report.teardowns


def test_calculator_errors_reach_an_ors_client_with_their_message() -> None:
    from plait.api import ToolError, ToolOutput
    from plait_sdk.client import ORSEnvironment, ORSOptions
    from plait_sdk.server import Server

    async def episode(url: str) -> tuple[Any, Any, Any]:
        remote = ORSEnvironment(ORSOptions(url=url))
        try:
            task = await remote.get_task("test", 0)
            session = await remote.open(task)
            try:
                return (
                    await session.call("calculator", {"expression": "2 ** 0.5"}),
                    await session.call("calculator", {"expression": task["expression"]}),
                    await session.call("final_answer", {"text": formatted(task)}),
                )
            finally:
                await session.close()
        finally:
            await remote.close()

    env = build("env", "math.calculator", options={})
    with Server([env.env_cls]).serve_in_thread() as url:
        error, value, final = asyncio.run(episode(url))
    assert (
        isinstance(error, ToolError) and "only whole-number exponents are supported" in error.error
    )
    assert isinstance(value, ToolOutput) and not value.finished
    assert isinstance(final, ToolOutput) and (final.reward, final.finished) == (1.0, True)
    assert final.metadata["correct"] is True
