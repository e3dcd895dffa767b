"""Every math environment end to end through plait's core Environment protocol, built through the
plugin registry exactly as a run config would build it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest

from plait import protocols
from plait.api import (
    ConfigError,
    EnvironmentError_,
    Message,
    ToolError,
    ToolOutput,
    build,
    get_registry,
)

ENVS = {
    "math.arith": {"preset": "tiny"},
    "math.gsm8k": {},
    "math.calculator": {},
}


def make(name: str, **options: Any) -> protocols.Environment:
    env = build("env", name, options=options, options_path="env.options")
    assert isinstance(env, protocols.Environment)
    return env


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_the_plugin_registers_three_lazy_envs() -> None:
    registry = get_registry()
    for name in ENVS:
        factory = registry.get("env", name)
        assert factory.plugin == "math" and factory.description
        assert isinstance(factory.target, str) and isinstance(factory.options, str)


def test_discovery_imports_no_environment_code() -> None:
    code = (
        "import sys\n"
        "from plait.plugins import get_registry\n"
        "names = get_registry().names('env')\n"
        "assert {'math.arith', 'math.gsm8k', 'math.calculator'} <= set(names), names\n"
        "heavy_modules = ('plait_math.arith', 'plait_math.gsm8k', 'plait_math.calculator_env',\n"
        "                 'reasoning_gym')\n"
        "heavy = [m for m in heavy_modules if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", list(ENVS))
def test_episode_through_the_core_protocol(name: str) -> None:
    async def episode() -> None:
        env = make(name, **ENVS[name])
        splits = {s.name: s.type for s in await env.splits()}
        assert splits["train"] == "train" and splits["test"] == "test"
        for split in splits:
            assert await env.num_tasks(split) > 0
        task = await env.get_task("test", 3)
        assert task == await env.get_task("test", 3)  # the same index, the same task
        assert task != await env.get_task("test", 4)
        session = await env.open(task)
        assert isinstance(session, protocols.EnvSession)
        prompt = await session.prompt()
        assert prompt and prompt[0].text == task["prompt"]
        messages = await session.messages()
        assert messages[0].role == "user" and messages[0].content == task["prompt"]
        terminal = await session.terminal_tool()
        assert terminal is not None and terminal.name == "final_answer"
        assert list(terminal.input_schema["properties"]) == ["text"]
        tool_names = {t.name for t in await session.tools()}
        assert "final_answer" not in tool_names
        answer = render_answer(task["answer"], task["answer_format"])
        output = await session.call(terminal.name, {"text": answer})
        assert isinstance(output, ToolOutput)
        assert (output.reward, output.finished) == (1.0, True)
        assert output.metadata["correct"] is True and output.metadata["expected"] == task["answer"]
        # the finished latch: nothing more is accepted
        again = await session.call(terminal.name, {"text": answer})
        assert isinstance(again, ToolError) and again.reason == "episode_finished"
        await session.close()
        await session.close()  # closing twice is safe
        await env.close()

    run(episode())


def render_answer(answer: str, answer_format: str) -> str:
    return {
        "plain": answer,
        "last_number": f"It is {answer}",
        "boxed": f"So \\boxed{{{answer}}}",
        "answer_tag": f"<answer>{answer}</answer>",
        "hash": f"Work.\n#### {answer}",
    }[answer_format]


@pytest.mark.parametrize("name", list(ENVS))
def test_wrong_and_unformatted_answers_score_zero(name: str) -> None:
    async def episode(text: str) -> ToolOutput:
        env = make(name, **ENVS[name])
        task = await env.get_task("train", 0)
        session = await env.open(task)
        try:
            output = await session.call(
                "final_answer", {"text": text.replace("ANSWER", task["answer"])}
            )
        finally:
            await session.close()
        assert isinstance(output, ToolOutput)
        return output

    wrong = run(episode("<answer>-123456789</answer>\n#### -123456789 \\boxed{-123456789}"))
    assert (wrong.reward, wrong.finished, wrong.metadata["correct"]) == (0.0, True, False)
    for hostile in [
        "",
        "\x00" * 10_000,
        "ANSWER" * 5000,
        "<answer><answer>ANSWER</answer></answer>",
    ]:
        output = run(episode(hostile))
        assert output.finished and output.reward in (0.0, 1.0)


def test_train_and_test_tasks_are_disjoint_through_the_env() -> None:
    async def prompts(env: protocols.Environment, split: str, n: int) -> set[str]:
        return {(await env.get_task(split, i))["expression"] for i in range(n)}

    env = make("math.arith", preset="default", seed=3)
    train, test = run(prompts(env, "train", 300)), run(prompts(env, "test", 300))
    assert not train & test


def test_index_out_of_range_and_unknown_split() -> None:
    env = make("math.arith", test_size=5)
    with pytest.raises(IndexError, match="out of range"):
        run(env.get_task("test", 5))
    with pytest.raises(KeyError, match="no split 'validation'"):
        run(env.num_tasks("validation"))


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ({"prompt": "1 + 1 ="}, "missing"),
        ({"prompt": "1 + 1 =", "answer": "two", "answer_format": "plain"}, "not a number"),
        ({"prompt": "1 + 1 =", "answer": "2", "answer_format": "latex"}, "answer_format"),
        ({"prompt": 5, "answer": "2", "answer_format": "plain"}, "prompt must be a string"),
    ],
)
def test_a_malformed_task_fails_open_with_the_cause(task: Mapping[str, Any], message: str) -> None:
    env = make("math.arith")
    with pytest.raises(EnvironmentError_, match=message):
        run(env.open(task))


def test_a_task_spec_alone_opens_an_episode() -> None:
    """Tasks are self-contained, as an ORS client's `task_spec` would send them."""

    async def episode() -> ToolOutput:
        session = await make("math.arith").open(
            {"prompt": "What is 6 * 7?", "answer": "42", "answer_format": "boxed"}
        )
        try:
            return await session.call("final_answer", {"text": "\\boxed{42}"})
        finally:
            await session.close()

    assert run(episode()).reward == 1.0


# -- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        (
            "math.arith",
            {"presett": "tiny"},
            r"env\.options\.presett: unknown key \(did you mean \"preset\"\?\)",
        ),
        (
            "math.arith",
            {"preset": "huge"},
            "preset 'huge' is not one of sums, tiny, smollm, default, hard",
        ),
        (
            "math.arith",
            {"max_digits": "2"},
            r"env\.options\.max_digits: expected int \| none, got str '2'",
        ),
        ("math.arith", {"min_digits": 3, "max_digits": 2}, "max_digits must be between min_digits"),
        ("math.arith", {"operators": ["+", "%"]}, r"operators: \['%'\] not supported"),
        (
            "math.arith",
            {"answer_format": "latex"},
            r"env\.options\.answer_format: expected 'plain' \| .*got str 'latex'",
        ),
        ("math.arith", {"preset": "tiny", "answer_format": "boxed"}, "prompt_style 'bare'"),
        ("math.arith", {"shots": -1}, "shots must be >= 0"),
        ("math.arith", {"wrong_format_reward": 2.0}, "wrong_format_reward must be between 0 and 1"),
        ("math.arith", {"test_fraction": 0.0}, "test_fraction must be strictly between 0 and 1"),
        ("math.arith", {"train_size": 0}, "train_size must be > 0"),
        (
            "math.gsm8k",
            {"answer_format": "latex"},
            r"env\.options\.answer_format: 'latex' is not one of",
        ),
        ("math.gsm8k", {"preset": "tiny"}, r"env\.options\.preset: unknown key"),
        (
            "math.calculator",
            {"prompt_style": "bare", "answer_format": "plain"},
            "cannot explain the calculator",
        ),
        ("math.calculator", {"max_calculator_calls": -1}, "max_calculator_calls must be >= 0"),
        ("math.calculator", {"preset": "tiny"}, "preset 'tiny' is not one of default, hard"),
    ],
)
def test_bad_options_fail_with_the_key(name: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build("env", name, options=options, options_path="env.options")


def test_presets_and_overrides() -> None:
    tiny = run(make("math.arith", preset="tiny").get_task("train", 0))
    assert tiny["answer_format"] == "plain" and tiny["prompt"].endswith(" =")
    a, b = tiny["expression"].split(" + ")
    assert int(a) < 10 and int(b) < 10
    overridden = run(
        make("math.arith", preset="tiny", max_digits=3, operators=["*"]).get_task("train", 0)
    )
    assert "*" in overridden["expression"]
    boxed = run(make("math.arith", answer_format="boxed").get_task("train", 0))
    assert "\\boxed{N}" in boxed["prompt"] and boxed["answer_format"] == "boxed"


def test_worked_examples_come_first_as_chat_turns_shared_by_every_task() -> None:
    async def opening(
        env: protocols.Environment, index: int
    ) -> tuple[dict[str, Any], list[Message]]:
        task = await env.get_task("train", index)
        session = await env.open(task)
        try:
            return task, await session.messages()
        finally:
            await session.close()

    sums = make("math.arith", preset="sums")
    (first, messages), (_, other) = run(opening(sums, 0)), run(opening(sums, 1))
    assert [m.role for m in messages] == ["user", "assistant"] * 3 + ["user"]
    assert messages[:-1] == other[:-1], "every task shares the examples, so prompts share a prefix"
    assert messages[-1].content == first["prompt"]
    for question, answer in zip(messages[0:-1:2], messages[1:-1:2], strict=True):
        a, b = question.content.removesuffix(" =").split(" + ")
        assert answer.content == str(int(a) + int(b))
    _, tagged = run(opening(make("math.arith", preset="default", shots=1), 0))
    assert (
        len(tagged) == 3
        and tagged[1].content.startswith("<answer>")
        and "answer tags" in tagged[0].content
    )
    _, none = run(opening(make("math.arith", preset="default"), 0))
    assert [m.role for m in none] == ["user"]


def test_wrong_format_reward_option() -> None:
    async def reward(**options: Any) -> float:
        env = make("math.arith", answer_format="answer_tag", **options)
        task = await env.get_task("train", 0)
        session = await env.open(task)
        output = await session.call("final_answer", {"text": f"The answer is {task['answer']}"})
        await session.close()
        return output.reward

    assert run(reward()) == 0.0
    assert run(reward(wrong_format_reward=0.3)) == 0.3
