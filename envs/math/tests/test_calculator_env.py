"""math.calculator: a multi-turn episode with calculator calls, tool errors and both ways to
answer."""

from __future__ import annotations

import asyncio
from typing import Any

from plait.api import Message, ToolError, ToolOutput, build


async def open_episode(**options: Any) -> tuple[Any, dict[str, Any]]:
    env = build("env", "math.calculator", options=options)
    task = await env.get_task("test", 0)
    return await env.open(task), task


def test_calculator_calls_then_a_text_answer() -> None:
    async def episode() -> None:
        session, task = await open_episode()
        assert "calculator" in task["prompt"]
        tools = {t.name: t for t in await session.tools()}
        assert set(tools) == {"calculator", "answer"}
        assert tools["calculator"].input_schema["required"] == ["expression"]
        result = await session.call("calculator", {"expression": task["expression"]})
        assert isinstance(result, ToolOutput) and not result.finished and result.reward is None
        assert result.text == task["answer"]
        assert (
            await session.call("calculator", {"expression": "7 / 2"})
        ).text == "3.5 (exactly 7/2)"
        error = await session.call("calculator", {"expression": "__import__('os')"})
        assert isinstance(error, ToolError) and "not allowed" in error.error
        error = await session.call("calculator", {"expression": "1 / 0"})
        assert isinstance(error, ToolError) and "division by zero" in error.error
        bad_input = await session.call("calculator", {"expr": "1"})
        assert isinstance(bad_input, ToolError) and bad_input.reason == "input_validation"
        final = await session.call("final_answer", {"text": f"<answer>{result.text}</answer>"})
        assert (final.reward, final.finished) == (1.0, True)
        late = await session.call("calculator", {"expression": "1 + 1"})
        assert isinstance(late, ToolError) and late.reason == "episode_finished"
        await session.close()

    asyncio.run(episode())


def test_the_answer_tool_takes_a_bare_number() -> None:
    async def answer(value: str) -> ToolOutput:
        session, task = await open_episode()
        output = await session.call("answer", {"answer": value.replace("ANSWER", task["answer"])})
        await session.close()
        return output

    assert asyncio.run(answer("ANSWER")).reward == 1.0
    assert asyncio.run(answer(" ANSWER ")).reward == 1.0
    wrong = asyncio.run(answer("The result is ANSWER"))
    assert (wrong.reward, wrong.finished) == (0.0, True)
    assert asyncio.run(answer("-1")).reward == 0.0


def test_the_call_budget_is_enforced_per_episode() -> None:
    async def episode() -> None:
        session, _ = await open_episode(max_calculator_calls=2)
        for _ in range(2):
            assert isinstance(await session.call("calculator", {"expression": "2 * 3"}), ToolOutput)
        over = await session.call("calculator", {"expression": "2 * 3"})
        assert isinstance(over, ToolError) and "2 times per task" in over.error
        await session.close()
        fresh, _ = await open_episode(max_calculator_calls=2)  # a new episode has its own budget
        assert isinstance(await fresh.call("calculator", {"expression": "2 * 3"}), ToolOutput)
        await fresh.close()

    asyncio.run(episode())


def test_calculator_tasks_are_harder_than_the_default_arith() -> None:
    async def answers(name: str) -> list[int]:
        env = build("env", name, options={})
        return [abs(int((await env.get_task("test", i))["answer"])) for i in range(50)]

    assert (
        sorted(asyncio.run(answers("math.calculator")))[25]
        > 10 * sorted(asyncio.run(answers("math.arith")))[25]
    )


def test_worked_examples_call_the_calculator_then_answer() -> None:
    """Each worked example is a calculator call on the whole expression, the tool's result (to
    the call's id) and the answer in the task's format; every task shares them."""

    async def opening(index: int) -> tuple[dict[str, Any], list[Message]]:
        env = build("env", "math.calculator", options={"shots": 2})
        task = await env.get_task("test", index)
        session = await env.open(task)
        try:
            return task, await session.messages()
        finally:
            await session.close()

    (task, messages), (_, other) = asyncio.run(opening(0)), asyncio.run(opening(1))
    assert [m.role for m in messages] == ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    assert messages[:-1] == other[:-1] and messages[-1].content == task["prompt"]
    for question, call, result, answer in zip(*(messages[i:-1:4] for i in range(4)), strict=True):
        (tool_call,) = call.tool_calls
        expression = tool_call.arguments["expression"]
        assert (tool_call.name, call.content) == ("calculator", "")
        assert question.content.startswith(f"Compute {expression}.")
        assert result.tool_call_id == tool_call.id and result.content == str(eval(expression))
        assert answer.content == f"<answer>{result.content}</answer>"
