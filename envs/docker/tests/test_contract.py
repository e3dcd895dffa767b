"""The SDK's environment contract kit, on the code environments (in-process and over ORS HTTP),
with the real sandbox grading every episode."""

from __future__ import annotations

import asyncio

import pytest

from plait.api import build
from plait_docker.tasks import python_tasks
from plait_sdk.testing import check_sdk_environment

pytestmark = pytest.mark.docker


def canonical_answer(task: dict) -> str:
    code_task = python_tasks().task(task["task_id"])
    return f"```python\n{code_task.prompt}{code_task.canonical_solution}```"


@pytest.mark.parametrize(
    ("name", "solve"),
    [
        ("code.python", lambda task: [("submit", {"answer": canonical_answer(task)})]),
        (
            "code.python_multiturn",
            lambda task: [
                ("run_python", {"code": "print('checking')"}),
                ("submit", {"answer": canonical_answer(task)}),
            ],
        ),
    ],
)
def test_code_envs_pass_the_sdk_contract_kit(name, solve):
    env = build("env", name, options={"sandbox": {"pool_size": 2, "timeout_s": 5}})
    try:
        report = check_sdk_environment(env.env_cls, reward_range=(0.0, 1.0), solve=solve)
    finally:
        asyncio.run(env.close())
    assert report.episodes >= 2  # in-process and over HTTP
    assert report.in_process.rewards and set(report.in_process.rewards) == {1.0}
    assert report.over_http is not None and set(report.over_http.rewards) == {1.0}
