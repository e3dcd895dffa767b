"""Grading a Python answer against a task's hidden unit tests, inside the sandbox.

Tasks have the HumanEval shape: a `prompt` (imports, helpers and the signature with its docstring),
an `entry_point` (the function to write), a `canonical_solution` (a completion of the prompt) and a
hidden `test` module defining `check(candidate)`. Each top-level statement of `check` that contains
an `assert` is one test; the other statements are set-up that runs before the tests after it. The
reward is the fraction of tests passed.

The test driver runs in the same interpreter as the answer (as in HumanEval's own harness), so the
sandbox protects the host, not the grade from an answer written to subvert it; the per-run nonce on
the result lines only keeps ordinary output from being mistaken for them.
"""

from __future__ import annotations

import ast
import re
import secrets
from collections.abc import Mapping
from typing import Any

import attrs

from plait_docker.sandbox import ExecutionResult, Sandbox, SandboxFault


@attrs.frozen
class CodeTask:
    task_id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CodeTask:
        return cls(**{f.name: data[f.name] for f in attrs.fields(cls)})


@attrs.frozen
class CheckPlan:
    """The hidden test module cut into statements: the prelude, then (source, is_test) steps."""

    prelude: str
    steps: tuple[tuple[str, bool], ...]

    @property
    def num_tests(self) -> int:
        return sum(is_test for _, is_test in self.steps)


def plan_tests(test_source: str) -> CheckPlan:
    module = ast.parse(test_source)
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if len(checks) != 1:
        raise ValueError("a task's test module must define exactly one function check(candidate)")
    prelude = ast.unparse(
        ast.Module(body=[n for n in module.body if n is not checks[0]], type_ignores=[])
    )
    steps = tuple(
        (ast.unparse(stmt), any(isinstance(n, ast.Assert) for n in ast.walk(stmt)))
        for stmt in checks[0].body
    )
    if not any(is_test for _, is_test in steps):
        raise ValueError("check(candidate) contains no assert statement, so nothing can be graded")
    return CheckPlan(prelude, steps)


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(answer: str, entry_point: str) -> str:
    """The code in a model's answer: the last fenced block that defines `entry_point`, else the
    first Python (or unlabelled) fenced block, else the whole answer."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(answer)]
    defining = [
        body
        for _, body in blocks
        if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", body, re.MULTILINE)
    ]
    if defining:
        return defining[-1]
    python = [body for lang, body in blocks if lang in ("", "python", "py", "python3")]
    return python[0] if python else answer


def _defines_at_top_level(code: str, name: str) -> bool:
    try:
        module = ast.parse(code)
    except SyntaxError:
        return False
    return any(
        isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
        for n in module.body
    )


def candidate_source(task: CodeTask, code: str) -> str:
    """The program under test: the prompt plus the answer. An answer that defines the function
    follows the prompt (so the prompt's imports and helpers stay); otherwise it is a completion
    of the prompt's function body, as HumanEval's canonical solutions are."""
    if _defines_at_top_level(code, task.entry_point):
        return task.prompt + "\n\n" + code
    return task.prompt + code


_DRIVER = """\
import os as _os
import traceback as _traceback

_NONCE = {nonce!r}
_write = _os.write


def _emit(kind, index, text=""):
    detail = text.replace("\\n", " ")[:300]
    line = "\\n" + _NONCE + " " + kind + " " + str(index) + " " + detail + "\\n"
    _write(1, line.encode("utf-8", "replace"))


_solution = {{"__name__": "solution"}}
try:
    exec(compile({candidate!r}, "solution.py", "exec"), _solution)
except BaseException as _exc:
    _emit("load_error", -1, _traceback.format_exception_only(_exc)[-1])
    raise SystemExit(1)
_scope = dict(_solution)
exec(compile({prelude!r}, "tests.py", "exec"), _scope)
if {entry_point!r} not in _solution:
    _emit("load_error", -1, "the answer does not define " + {entry_point!r})
    raise SystemExit(1)
_scope["candidate"] = _solution[{entry_point!r}]
_test_index = 0
for _step, _is_test in {steps!r}:
    try:
        exec(compile(_step, "tests.py", "exec"), _scope)
    except BaseException as _exc:
        if _is_test:
            _emit("fail", _test_index, _traceback.format_exception_only(_exc)[-1])
    else:
        if _is_test:
            _emit("pass", _test_index)
    _test_index += _is_test
_emit("done", _test_index)
"""


def grading_program(task: CodeTask, code: str, nonce: str) -> str:
    plan = plan_tests(task.test)
    return _DRIVER.format(
        nonce=nonce,
        candidate=candidate_source(task, code),
        prelude=plan.prelude,
        entry_point=task.entry_point,
        steps=plan.steps,
    )


@attrs.frozen
class Grade:
    tests_passed: int
    tests_total: int
    execution: ExecutionResult
    failures: tuple[str, ...] = ()  # the first lines of failed tests' errors

    @property
    def reward(self) -> float:
        return self.tests_passed / self.tests_total

    @property
    def passed(self) -> bool:
        return self.tests_passed == self.tests_total and self.execution.ok

    def metadata(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "tests_passed": self.tests_passed,
            "tests_total": self.tests_total,
            "execution": self.execution.reason,
            "execution_detail": self.execution.detail,
        }

    def summary(self) -> str:
        execution = f"{self.execution.reason}: {self.execution.detail}"
        head = f"{self.tests_passed}/{self.tests_total} hidden tests passed ({execution})"
        return "\n".join([head, *self.failures[:3]])


def read_grade(task: CodeTask, result: ExecutionResult, nonce: str) -> Grade:
    """Count the tests the driver reported passed; a test reported both ways, or not at all,
    failed."""
    total = plan_tests(task.test).num_tests
    outcomes: dict[int, str] = {}
    failures = []
    prefix = nonce + " "
    for line in result.stdout.splitlines():
        if not line.startswith(prefix):
            continue
        kind, _, rest = line[len(prefix) :].partition(" ")
        index_text, _, text = rest.partition(" ")
        if kind == "load_error":
            failures.append(f"the answer failed to load: {text}")
        elif kind in ("pass", "fail") and index_text.isdigit() and int(index_text) < total:
            index = int(index_text)
            outcomes[index] = "fail" if outcomes.get(index) == "fail" else kind
            if kind == "fail":
                failures.append(f"test {index + 1} failed: {text}")
    passed = sum(1 for v in outcomes.values() if v == "pass")
    return Grade(passed, total, result, tuple(failures))


def new_nonce() -> str:
    return "PLAIT-" + secrets.token_hex(8)


async def grade_answer(
    sandbox: Sandbox, task: CodeTask, code: str, *, timeout_s: float | None = None
) -> Grade:
    """Run `code` (the answer's code, see `extract_code`) against the task's hidden tests in the
    sandbox.

    Raises `SandboxFault` when the sandbox failed (`ExecutionResult.engine_fault`): the answer's
    outcome is then unknown, and grading it 0 would blame it for the engine."""
    nonce = new_nonce()
    result = await sandbox.run(grading_program(task, code, nonce), timeout_s=timeout_s)
    if result.engine_fault:
        raise SandboxFault(
            f"the sandbox failed while grading {task.task_id}: {result.detail}",
            fix="submit the answer again; if this repeats, check the Docker engine",
        )
    return read_grade(task, result, nonce)
