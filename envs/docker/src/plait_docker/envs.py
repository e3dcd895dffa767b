"""Code environments: Python tasks graded by hidden unit tests in the sandbox.

- `code.humaneval`, `code.python`: single turn. The model answers in plain text; the answer goes to
  the terminal tool `submit`, which grades it: reward = fraction of hidden tests passed, and
  `metadata["passed"]` is true when all pass.
- `code.humaneval_multiturn`, `code.python_multiturn`: the model may call `run_python` (run any
  program in the sandbox and see its output) up to `max_tool_calls` times before its final answer.

Creating an environment starts its sandbox pool, so it fails at once, saying how to fix it, when no
Docker engine is reachable or the image is not built. All sessions of an environment share the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from plait.api import EnvironmentError_, positive
from plait_docker.grading import CodeTask, extract_code, grade_answer
from plait_docker.sandbox import Sandbox, SandboxFault, SandboxOptions
from plait_docker.tasks import TaskSet, humaneval_tasks, python_tasks
from plait_sdk import Environment, LocalEnvironment, Split, TextBlock, ToolOutput, terminal, tool


@attrs.frozen
class CodeEnvOptions:
    """Options of `code.humaneval` and `code.python` (the `env.options` table)."""

    sandbox: SandboxOptions = attrs.field(factory=SandboxOptions)


@attrs.frozen
class MultiTurnCodeEnvOptions:
    """Options of the multi-turn code environments."""

    sandbox: SandboxOptions = attrs.field(factory=SandboxOptions)
    max_tool_calls: int = attrs.field(default=8, validator=positive)  # run_python calls per episode


SINGLE_TURN_INSTRUCTIONS = (
    "Complete the Python function below. Reply with the complete function (with any imports it "
    "needs) in one ```python code block. Hidden unit tests will check it."
)
MULTI_TURN_INSTRUCTIONS = (
    "Complete the Python function below. You may call the tool `run_python` to run Python programs "
    "and see their output (at most {max_calls} times). When you are done, reply with the complete "
    "function (with any imports it needs) in one ```python code block and no tool call. Hidden "
    "unit tests will check it."
)


class CodeEnv(Environment):
    """One task of a task set; the plain-text answer is graded by the terminal tool `submit`."""

    task_set: ClassVar[TaskSet]
    sandbox: ClassVar[Sandbox]

    @classmethod
    def list_splits(cls) -> list[Split]:
        return list(cls.task_set.splits)

    @classmethod
    def list_tasks(cls, split: str) -> list[dict[str, Any]]:
        return [{"task_id": task.task_id} for task in cls.task_set.split(split)]

    @property
    def task(self) -> CodeTask:
        return self.task_set.task(self.task_spec["task_id"])

    def setup(self) -> None:
        if "task_id" not in self.task_spec:
            raise EnvironmentError_(
                f"a code task needs a task_id, got {dict(self.task_spec)}",
                fix="open the environment on a task from its task list",
            )
        self.task  # noqa: B018 - raises for an unknown task id

    def instructions(self) -> str:
        return SINGLE_TURN_INSTRUCTIONS

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(f"{self.instructions()}\n\n```python\n{self.task.prompt}```")]

    @terminal
    async def submit(self, answer: str) -> ToolOutput:
        """Submit the final answer: the complete function in a ```python code block."""
        # A fault of the sandbox raises SandboxFault: the call fails (a tool error) and the episode
        # goes on, rather than scoring the answer for what the engine did.
        task = self.task
        grade = await grade_answer(self.sandbox, task, extract_code(answer, task.entry_point))
        return ToolOutput(
            blocks=[TextBlock(grade.summary())],
            reward=grade.reward,
            finished=True,
            metadata={"task_id": task.task_id, **grade.metadata()},
        )


class MultiTurnCodeEnv(CodeEnv):
    """`CodeEnv` plus the `run_python` tool."""

    max_tool_calls: ClassVar[int]

    def __init__(
        self, task_spec: Mapping[str, Any] | None = None, secrets: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(task_spec, secrets)
        self.tool_calls = 0

    def instructions(self) -> str:
        return MULTI_TURN_INSTRUCTIONS.format(max_calls=self.max_tool_calls)

    @tool
    async def run_python(self, code: str) -> ToolOutput:
        """Run a Python 3.11 program in a sandbox (no network, standard library only, a few seconds
        of time) and return its exit status, stdout and stderr."""
        if self.tool_calls >= self.max_tool_calls:
            return ToolOutput(
                blocks=[
                    TextBlock(
                        f"run_python may be called at most {self.max_tool_calls} times; submit "
                        "your answer now."
                    )
                ],
                metadata={"execution": "refused"},
            )
        result = await self.sandbox.run(code)
        if result.engine_fault:  # not the model's doing: the call fails and is not counted
            raise SandboxFault(f"the sandbox failed: {result.detail}", fix="call run_python again")
        self.tool_calls += 1
        return ToolOutput(
            blocks=[TextBlock(result.summary())], metadata={"execution": result.reason}
        )


class DockerEnvironment(LocalEnvironment):
    """A code environment behind the core protocol; `close()` removes its sandbox's containers."""

    def __init__(self, env_cls: type[CodeEnv], *, name: str) -> None:
        super().__init__(env_cls, name=name)
        self.sandbox = env_cls.sandbox

    async def close(self) -> None:
        await asyncio.to_thread(self.sandbox.close)


def _environment(
    name: str,
    base: type[CodeEnv],
    task_set: TaskSet,
    sandbox_options: SandboxOptions,
    **class_attrs: Any,
) -> DockerEnvironment:
    sandbox = Sandbox(sandbox_options)
    env_cls = type(
        base.__name__, (base,), {"task_set": task_set, "sandbox": sandbox, **class_attrs}
    )
    return DockerEnvironment(env_cls, name=name)


def humaneval(*, options: CodeEnvOptions | None = None) -> DockerEnvironment:
    options = options or CodeEnvOptions()
    return _environment("code.humaneval", CodeEnv, humaneval_tasks(), options.sandbox)


def python(*, options: CodeEnvOptions | None = None) -> DockerEnvironment:
    options = options or CodeEnvOptions()
    return _environment("code.python", CodeEnv, python_tasks(), options.sandbox)


def humaneval_multiturn(*, options: MultiTurnCodeEnvOptions | None = None) -> DockerEnvironment:
    options = options or MultiTurnCodeEnvOptions()
    return _environment(
        "code.humaneval_multiturn",
        MultiTurnCodeEnv,
        humaneval_tasks(),
        options.sandbox,
        max_tool_calls=options.max_tool_calls,
    )


def python_multiturn(*, options: MultiTurnCodeEnvOptions | None = None) -> DockerEnvironment:
    options = options or MultiTurnCodeEnvOptions()
    return _environment(
        "code.python_multiturn",
        MultiTurnCodeEnv,
        python_tasks(),
        options.sandbox,
        max_tool_calls=options.max_tool_calls,
    )
