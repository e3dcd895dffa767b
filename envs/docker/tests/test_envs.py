"""The code environments through the core protocol, on the real engine."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from plait.api import Environment, EnvironmentError_, ToolError, build
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
    env = build(
        "env", "code.python_multiturn", options={"max_tool_calls": 2, "sandbox": {"pool_size": 1}}
    )
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
        return (
            splits,
            task,
            await session.prompt(),
            await session.tools(),
            await session.terminal_tool(),
        )

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
        return await asyncio.gather(
            *(
                submit(
                    python_env,
                    t["task_id"],
                    f"```python\n{t['prompt']}{t['canonical_solution']}```",
                )
                for t in TASKS
            )
        )

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


@pytest.mark.parametrize(
    ("answer", "execution"),
    [
        ("I do not know.", "error"),  # no code at all: a syntax error
        ("```python\ndef is_prime(n):\n    while True:\n        pass\n```", "timeout"),
        (
            "```python\nimport os\nos.kill(os.getppid(), 9)\n```",
            "error",
        ),  # the runner is out of its reach
    ],
)
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
        final = await session.call(
            "submit", {"answer": f"```python\n{task['prompt']}{task['canonical_solution']}```"}
        )
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


@pytest.fixture(scope="module")
def one_container_env():
    env = build("env", "code.python", options={"sandbox": {"pool_size": 1, "timeout_s": 5}})
    yield env
    run(env.close())


def canonical(task_id: str) -> str:
    task = python_tasks().task(task_id)
    return f"```python\n{task.prompt}{task.canonical_solution}```"


SYSV_POISON = """```python
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
libc.shmdt.argtypes = (ctypes.c_void_p,)
while True:  # until shmget fails or the memory limit strikes
    shm = libc.shmget(0, 1 << 20, 0o1000 | 0o600)
    if shm < 0:
        break
    status = ctypes.create_string_buffer(512)
    libc.shmctl(shm, 2, status)  # IPC_STAT
    ctypes.c_uint32.from_buffer(status, 4).value = 10000  # hand it over to PID 1's user
    libc.shmctl(shm, 1, status)  # IPC_SET
    addr = libc.shmat(shm, None, 0)
    ctypes.memset(addr, 1, 1 << 20)  # charged to the container's memory
    libc.shmdt(addr)

def is_palindrome(text):
    return True
```"""


def test_a_poisoning_submission_does_not_cost_later_grades(one_container_env):
    # a correct answer that needs a little memory (8 MiB) for a table
    with_a_table = canonical("plait/1").replace(
        "```python\n", "```python\n_table = bytearray(8 << 20)\n", 1
    )

    async def episodes():
        poisoned = await submit(one_container_env, "plait/1", SYSV_POISON)
        later = [
            await submit(one_container_env, "plait/1", answer)
            for answer in (canonical("plait/1"), with_a_table, with_a_table)
        ]
        return poisoned, later

    poisoned, later = run(episodes())
    assert poisoned.reward < 1.0
    assert [(o.reward, o.metadata["passed"]) for o in later] == [(1.0, True)] * 3, later


def test_an_engine_fault_during_submit_is_an_error_not_a_score(one_container_env):
    # a correct answer that takes a while, and the container is paused from outside meanwhile
    slow = canonical("plait/1").replace("```python\n", "```python\nimport time\ntime.sleep(3)\n", 1)
    sandbox = one_container_env.sandbox

    def pause_soon():
        time.sleep(1.0)
        for container in sandbox.client.containers.list(
            filters={"label": f"plait.sandbox.pool={sandbox.pool_id}"}
        ):
            container.pause()

    async def episode():
        session = await one_container_env.open({"task_id": "plait/1"})
        pauser = threading.Thread(target=pause_soon)
        pauser.start()
        faulted = await session.call("submit", {"answer": slow})
        pauser.join()
        retried = await session.call(
            "submit", {"answer": canonical("plait/1")}
        )  # the episode goes on
        await session.close()
        return faulted, retried

    faulted, retried = run(episode())
    assert isinstance(faulted, ToolError) and faulted.reason == "exception", faulted
    assert "paused" in faulted.error
    assert retried.finished and retried.reward == 1.0 and retried.metadata["passed"] is True
