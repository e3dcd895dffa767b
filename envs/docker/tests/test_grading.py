"""Grading logic on the host side: cutting tests, finding code in answers, reading results."""

from __future__ import annotations

import pytest

from plait_docker.grading import (
    CodeTask,
    candidate_source,
    extract_code,
    grading_program,
    new_nonce,
    plan_tests,
    read_grade,
)
from plait_docker.python_tasks import TASKS
from plait_docker.sandbox import ExecutionResult
from plait_docker.tasks import humaneval_tasks, python_tasks

TASK = CodeTask.from_dict(TASKS[0])  # running_sum, 5 tests


def ran(stdout: str, reason: str = "ok") -> ExecutionResult:
    return ExecutionResult(reason=reason, detail="", stdout=stdout)


def test_every_humaneval_test_module_is_cut_into_tests():
    tasks = humaneval_tasks().tasks
    assert len(tasks) == 164
    counts = [plan_tests(t.test).num_tests for t in tasks]
    assert min(counts) >= 1
    # HumanEval/53's check: five asserts, then a for loop holding one more (one test), after an
    # import
    plan = plan_tests(humaneval_tasks().task("HumanEval/53").test)
    assert plan.num_tests == 6
    assert [is_test for _, is_test in plan.steps] == [False, True, True, True, True, True, True]
    assert "METADATA" in plan.prelude


def test_a_test_module_without_check_or_asserts_is_rejected():
    with pytest.raises(ValueError, match="check"):
        plan_tests("def other(candidate):\n    assert candidate()\n")
    with pytest.raises(ValueError, match="no assert"):
        plan_tests("def check(candidate):\n    candidate()\n")


def test_splits_hold_out_every_fifth_task():
    for task_set, total in ((humaneval_tasks(), 164), (python_tasks(), 20)):
        train, test = task_set.split("train"), task_set.split("test")
        assert len(train) + len(test) == total
        assert not {t.task_id for t in train} & {t.task_id for t in test}
    assert python_tasks().task("plait/5").entry_point == "is_prime"
    with pytest.raises(KeyError, match="unknown task id"):
        python_tasks().task("plait/999")


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("Here:\n```python\ndef f():\n    return 1\n```\nDone.", "def f():\n    return 1\n"),
        (
            "```\nx = 1\n```\n```python\ndef f(): return 2\n```",
            "def f(): return 2\n",
        ),  # the block defining f
        ("```py\nprint(3)\n```", "print(3)\n"),
        ("    return 1\n", "    return 1\n"),  # no fence: the whole answer
        (
            "```python\ndef f(): return 1\n```\n```python\ndef f(): return 2\n```",
            "def f(): return 2\n",
        ),
    ],
)
def test_extract_code(answer, expected):
    assert extract_code(answer, "f") == expected


def test_candidate_source_keeps_the_prompt_for_full_functions_and_completions():
    full = "def running_sum(numbers):\n    return numbers\n"
    assert candidate_source(TASK, full) == TASK.prompt + "\n\n" + full
    assert candidate_source(TASK, TASK.canonical_solution) == TASK.prompt + TASK.canonical_solution
    # a nested def of the same name is not a top-level definition: completion mode
    assert candidate_source(TASK, "    def running_sum(): pass\n").startswith(
        TASK.prompt + "    def"
    )


def test_test_program_is_valid_python_with_the_nonce():
    nonce = new_nonce()
    program = grading_program(TASK, TASK.canonical_solution, nonce)
    compile(program, "driver.py", "exec")
    assert nonce in program
    assert new_nonce() != nonce


def test_read_grade_counts_only_nonce_lines_and_a_contradicted_pass_fails():
    nonce = "PLAIT-abc"
    stdout = "\n".join(
        [
            "PLAIT-abc pass 0 ",
            "PLAIT-abc pass 1 ",
            "PLAIT-abc fail 1 AssertionError",  # reported both ways: failed
            "PLAIT-xyz pass 2 ",  # another nonce: ignored
            "pass 3",
            "PLAIT-abc pass 4 ",
            "PLAIT-abc pass 99 ",  # out of range: ignored
            "PLAIT-abc done 5 ",
        ]
    )
    grade = read_grade(TASK, ran(stdout), nonce)
    assert (grade.tests_passed, grade.tests_total) == (2, 5)
    assert grade.reward == pytest.approx(0.4)
    assert not grade.passed
    assert grade.failures == ("test 2 failed: AssertionError",)
    assert grade.metadata()["tests_total"] == 5


def test_all_tests_passed_is_a_pass_only_for_a_clean_execution():
    stdout = "\n".join(f"PLAIT-n pass {i} " for i in range(5))
    assert read_grade(TASK, ran(stdout), "PLAIT-n").passed
    dirty = read_grade(TASK, ran(stdout, reason="background_processes"), "PLAIT-n")
    assert dirty.reward == 1.0 and not dirty.passed


def test_load_errors_are_reported():
    grade = read_grade(
        TASK, ran("PLAIT-n load_error -1 SyntaxError: invalid syntax\n", reason="error"), "PLAIT-n"
    )
    assert grade.tests_passed == 0
    assert "failed to load" in grade.summary()
