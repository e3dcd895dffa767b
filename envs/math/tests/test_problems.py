"""The arithmetic generator: determinism, disjoint splits, knobs, and right answers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from plait_math.calculator import evaluate
from plait_math.problems import Problem, ProblemSpec, generate, split_of


def spec(**overrides: object) -> ProblemSpec:
    values: dict[str, object] = dict(
        min_digits=1,
        max_digits=2,
        min_terms=2,
        max_terms=4,
        operators=("+", "-", "*", "/"),
        negatives=True,
        test_fraction=0.2,
    )
    values.update(overrides)
    return ProblemSpec(**values)  # type: ignore[arg-type]


def test_same_seed_split_index_gives_the_same_problem() -> None:
    s = spec()
    first = [generate(s, 7, "train", i) for i in range(50)]
    assert first == [generate(s, 7, "train", i) for i in range(50)]
    assert first != [generate(s, 8, "train", i) for i in range(50)]
    # the index alone picks the problem: asking out of order changes nothing
    assert [generate(s, 7, "train", i) for i in reversed(range(50))] == first[::-1]


def test_problems_do_not_depend_on_the_process() -> None:
    """Another interpreter (other hash seed) generates the same problems: no hash() or global
    RNG."""
    code = (
        "from plait_math.problems import ProblemSpec, generate\n"
        "s = ProblemSpec(1, 2, 2, 4, ('+', '-', '*', '/'), True, 0.2)\n"
        "print([generate(s, 7, sp, i).expression for sp in ('train', 'test') for i in range(20)])"
    )
    here = [generate(spec(), 7, sp, i).expression for sp in ("train", "test") for i in range(20)]
    for hash_seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )
        assert out.stdout.strip() == repr(here)


@pytest.mark.parametrize(
    "knobs",
    [
        dict(),
        dict(
            min_digits=1, max_digits=1, min_terms=2, max_terms=2, operators=("+",), negatives=False
        ),
        dict(min_digits=3, max_digits=3, operators=("*",), negatives=False),
    ],
)
def test_train_and_test_never_share_a_problem(knobs: dict[str, object]) -> None:
    s = spec(**knobs)
    for seed_train, seed_test in [(0, 0), (0, 1), (5, 3)]:
        train = {generate(s, seed_train, "train", i).canonical() for i in range(400)}
        test = {generate(s, seed_test, "test", i).canonical() for i in range(200)}
        assert not train & test
    assert all(
        split_of(generate(s, 0, split, i), s.test_fraction) == split
        for split in ("train", "test")
        for i in range(100)
    )


def test_commuted_sums_share_a_split() -> None:
    a, b = Problem((3, 5), ("+",)), Problem((5, 3), ("+",))
    assert a.canonical() == b.canonical()
    assert split_of(a, 0.5) == split_of(b, 0.5)
    assert Problem((3, 5), ("-",)).canonical() != Problem((5, 3), ("-",)).canonical()


def test_tiny_problem_space_still_splits() -> None:
    s = spec(
        min_digits=1, max_digits=1, min_terms=2, max_terms=2, operators=("+",), negatives=False
    )
    test = {generate(s, 0, "test", i).canonical() for i in range(300)}
    train = {generate(s, 0, "train", i).canonical() for i in range(1000)}
    assert 3 <= len(test) <= 25 and len(train) >= 30  # 55 unordered pairs, about 20% in test
    assert not train & test


def test_unknown_split_is_an_error() -> None:
    with pytest.raises(ValueError, match="split must be one of"):
        generate(spec(), 0, "validation", 0)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    index=st.integers(0, 10**6),
    split=st.sampled_from(["train", "test"]),
    min_digits=st.integers(1, 3),
    extra_digits=st.integers(0, 2),
    min_terms=st.integers(2, 4),
    extra_terms=st.integers(0, 3),
    negatives=st.booleans(),
    operators=st.lists(st.sampled_from(["+", "-", "*", "/"]), min_size=1, max_size=4, unique=True),
)
def test_problems_respect_the_knobs_and_have_right_answers(
    seed: int,
    index: int,
    split: str,
    min_digits: int,
    extra_digits: int,
    min_terms: int,
    extra_terms: int,
    negatives: bool,
    operators: list[str],
) -> None:
    s = spec(
        min_digits=min_digits,
        max_digits=min_digits + extra_digits,
        min_terms=min_terms,
        max_terms=min_terms + extra_terms,
        operators=tuple(operators),
        negatives=negatives,
    )
    problem = generate(s, seed, split, index)
    assert s.min_terms <= len(problem.operands) <= s.max_terms
    assert set(problem.operators) <= set(operators)
    assert negatives or all(v >= 0 for v in problem.operands)
    for op, value in zip(problem.operators, problem.operands[1:], strict=True):
        if op != "/":
            assert len(str(abs(value))) <= s.max_digits
        else:
            assert value != 0
    # the answer agrees with an independent evaluator, and division is always exact
    assert evaluate(problem.expression) == problem.answer
    assert problem.answer.denominator == 1


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (dict(min_digits=0), "min_digits"),
        (dict(min_digits=3, max_digits=2), "max_digits"),
        (dict(min_terms=1), "min_terms"),
        (dict(min_terms=4, max_terms=3), "max_terms"),
        (dict(operators=()), "operators"),
        (dict(operators=("+", "^")), "operators"),
        (dict(test_fraction=1.0), "test_fraction"),
    ],
)
def test_bad_knobs_name_the_key(knobs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec(**knobs).check()
