"""The code environments through the core protocol, on the real engine."""

from __future__ import annotations

import asyncio

import pytest

from plait.errors import EnvironmentError_
from plait.plugins import build
from plait.protocols import Environment
from plait.types import ToolError
from plait_docker.python_tasks import TASKS
from plait_docker.tasks import python_tasks

pytestmark = pytest.mark.docker


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def python_env():
    env = build("env", "code.python", options={"sandbox": {"pool_size": 2, "timeout_s": 3}})
    yield env
    run(env.close())


@pytest.fixture(scope="module")
def multiturn_env():
    env = build("env", "code.python_multiturn", options={"max_tool_calls": 2, "sandbox": {"pool_size": 1}})
    yield env
    run(env.close())


async def submit(env, task_id: str, answer: str):
    session = await env.open({"task_id": task_id})
    try:
        return await session.call("submit", {"answer": answer})
    finally:
        await session.close()


def test_the_env_speaks_the_core_protocol_and_hides_the_tests(python_env):
    assert isinstance(python_env, Environment)

    async def look():
        splits = await python_env.splits()
        task = await python_env.get_task("train", 0)
        session = await python_env.open(task)
        return splits, task, await session.prompt(), await session.tools(), await session.terminal_tool()

    splits, task, prompt, tools, terminal = run(look())
    assert [s.name for s in splits] == ["train", "test"]
    assert task == {"task_id": "plait/1"}  # only the id leaves the environment
    text = prompt[0].text
    assert "def is_palindrome(text: str) -> bool:" in text and "```python" in text
    assert "check(" not in text and "assert" not in text
    assert tools == []  # single turn: the answer goes to the terminal tool
    assert terminal.name == "submit"


def test_every_own_canonical_solution_passes(python_env):
    async def all_tasks():
        return await asyncio.gather(*(
            submit(python_env, t["task_id"], f"```python\n{t['prompt']}{t['canonical_solution']}```") for t in TASKS))

    outputs = run(all_tasks())
    assert [(o.reward, o.metadata["passed"]) for o in outputs] == [(1.0, True)] * len(TASKS)
    assert {o.metadata["task_id"] for o in outputs} == {t.task_id for t in python_tasks().tasks}


def test_reward_is_the_fraction_of_hidden_tests_and_the_episode_finishes(python_env):
    # gcd without the loop passes only the tests where b == 0: gcd(5, 0) and gcd(0, 0)
    answer = "Sure:\n```python\ndef gcd(a, b):\n    return a\n```"

    async def episode():
        session = await python_env.open({"task_id": "plait/4"})
        first = await session.call("submit", {"answer": answer})
        second = await session.call("submit", {"answer": answer})
        await session.close()
        return first, second

    first, second = run(episode())
    assert first.finished and first.reward == pytest.approx(2 / 6)
    assert first.metadata["passed"] is False and first.metadata["tests_passed"] == 2
    assert "2/6 hidden tests passed" in first.text
    assert isinstance(second, ToolError) and second.reason == "episode_finished"


@pytest.mark.parametrize(("answer", "execution"), [
    ("I do not know.", "error"),  # no code at all: a syntax error
    ("```python\ndef is_prime(n):\n    while True:\n        pass\n```", "timeout"),
    ("```python\nimport os\nos.kill(os.getppid(), 9)\n```", "sandbox_error"),
])
def test_broken_answers_get_zero_reward(python_env, answer, execution):
    out = run(submit(python_env, "plait/5", answer))
    assert out.reward == 0.0 and out.metadata["passed"] is False
    assert out.metadata["execution"] == execution


def test_unknown_task_fails_on_open(python_env):
    with pytest.raises(EnvironmentError_, match="unknown task id"):
        run(python_env.open({"task_id": "plait/404"}))


def test_multiturn_run_python_then_submit(multiturn_env):
    async def episode():
        session = await multiturn_env.open({"task_id": "plait/0"})
        tools = await session.tools()
        prompt = await session.prompt()
        ran = await session.call("run_python", {"code": "print(sum([1, 2, 3]))"})
        crashed = await session.call("run_python", {"code": "while True: pass"})
        refused = await session.call("run_python", {"code": "print(1)"})
        bad_input = await session.call("run_python", {"source": "print(1)"})
        task = TASKS[0]
        final = await session.call("submit", {"answer": f"```python\n{task['prompt']}{task['canonical_solution']}```"})
        await session.close()
        return tools, prompt, ran, crashed, refused, bad_input, final

    tools, prompt, ran, crashed, refused, bad_input, final = run(episode())
    assert [t.name for t in tools] == ["run_python"]
    assert "run_python" in prompt[0].text and "at most 2 times" in prompt[0].text
    assert ran.reward is None and not ran.finished
    assert ran.text.startswith("[ok]") and "stdout:\n6" in ran.text
    assert crashed.metadata["execution"] == "timeout" and "[timeout]" in crashed.text
    assert refused.metadata["execution"] == "refused" and "at most 2 times" in refused.text
    assert isinstance(bad_input, ToolError) and bad_input.reason == "input_validation"
    assert final.finished and final.reward == 1.0 and final.metadata["passed"] is True


def test_a_missing_image_fails_with_the_build_command():
    with pytest.raises(Exception, match="not built") as err:
        build("env", "code.python", options={"sandbox": {"image": "plait-sandbox:does-not-exist"}})
    assert "plait-docker build-image" in err.value.fix
