"""Every HumanEval canonical solution passes through the sandbox, and wrong solutions fail."""

from __future__ import annotations

import asyncio

import pytest

from plait.api import build
from plait_docker.tasks import humaneval_tasks

pytestmark = [pytest.mark.docker, pytest.mark.slow]


async def submit_all(env, answers: dict[str, str]) -> dict[str, object]:
    async def one(task_id: str, answer: str):
        session = await env.open({"task_id": task_id})
        try:
            return task_id, await session.call("submit", {"answer": answer})
        finally:
            await session.close()

    return dict(await asyncio.gather(*(one(t, a) for t, a in answers.items())))


@pytest.fixture(scope="module")
def env():
    environment = build("env", "code.humaneval", options={"sandbox": {"pool_size": 2}})
    yield environment
    asyncio.run(environment.close())


def test_every_canonical_solution_passes(env):
    tasks = humaneval_tasks().tasks
    # answered as a model would: the prompt's function completed, in a code block
    answers = {t.task_id: f"```python\n{t.prompt}{t.canonical_solution}```" for t in tasks}
    outputs = asyncio.run(submit_all(env, answers))
    failed = {
        tid: out.text
        for tid, out in outputs.items()
        if out.reward != 1.0 or not out.metadata["passed"]
    }
    assert failed == {}
    assert all(out.finished for out in outputs.values())


def test_wrong_solutions_fail(env):
    tasks = humaneval_tasks().tasks[::16]  # 11 tasks across the set
    answers = {t.task_id: f"```python\n{t.prompt}    return None\n```" for t in tasks}
    # and one canonical solution grafted onto the wrong task
    answers[tasks[1].task_id] = f"```python\n{tasks[1].prompt}{tasks[2].canonical_solution}```"
    outputs = asyncio.run(submit_all(env, answers))
    for task_id, out in outputs.items():
        assert out.metadata["passed"] is False, task_id
        assert out.reward < 1.0, (task_id, out.text)


def test_partial_credit_is_the_fraction_of_tests_passed(env):
    # has_close_elements always answering False passes the 3 of its 7 tests that expect False
    answer = "def has_close_elements(numbers, threshold):\n    return False\n"
    outputs = asyncio.run(submit_all(env, {"HumanEval/0": answer}))
    out = outputs["HumanEval/0"]
    assert (out.metadata["tests_passed"], out.metadata["tests_total"]) == (3, 7)
    assert out.reward == pytest.approx(3 / 7)
