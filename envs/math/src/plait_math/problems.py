"""Seeded arithmetic problems: the same (seed, split, index) always gives the same problem.

Why not reasoning-gym's `basic_arithmetic` / `chain_sum`: both seed item i with `Random(seed + i)`,
so the streams of seeds s and s+1 overlap (item i+1 of one is item i of the other) and seeds alone
cannot keep train and test apart; `basic_arithmetic` writes floor division as `/` and draws negative
operands even with `allow_negation=False`. Multiplication and exact division are also not in
`chain_sum`. The generator below is short and has exactly the knobs the presets need.

Train/test disjointness is by construction, on content: every problem has a split, decided by a
hash of its canonical form (operands sorted for pure sums and pure products, so `3 + 5` and
`5 + 3` land in the same split). Item (seed, split, index) is drawn from its own random stream and
redrawn until the problem belongs to `split`. A problem is therefore never in both splits, for any
seeds. Within a split problems may repeat when the problem space is small (e.g. single-digit a+b
has 100 problems, about `test_fraction` of them in test).
"""

from __future__ import annotations

import hashlib
import random
from fractions import Fraction

import attrs

OPERATORS = ("+", "-", "*", "/")
SPLITS = ("train", "test")
MAX_DRAWS = 10_000  # redraws allowed to find a problem of the requested split


@attrs.frozen
class ProblemSpec:
    """The difficulty knobs of an arithmetic problem family."""

    min_digits: int
    max_digits: int
    min_terms: int
    max_terms: int
    operators: tuple[str, ...]
    negatives: bool
    test_fraction: float

    def check(self) -> None:
        """Raise ValueError naming the option key that is out of range."""
        if not 1 <= self.min_digits <= 18:
            raise ValueError(f"min_digits must be between 1 and 18, got {self.min_digits}")
        if not self.min_digits <= self.max_digits <= 18:
            raise ValueError(
                f"max_digits must be between min_digits ({self.min_digits}) and 18, "
                f"got {self.max_digits}"
            )
        if not 2 <= self.min_terms <= 32:
            raise ValueError(f"min_terms must be between 2 and 32, got {self.min_terms}")
        if not self.min_terms <= self.max_terms <= 32:
            raise ValueError(
                f"max_terms must be between min_terms ({self.min_terms}) and 32, "
                f"got {self.max_terms}"
            )
        if not self.operators:
            raise ValueError(f"operators must list at least one of {', '.join(OPERATORS)}")
        unknown = [op for op in self.operators if op not in OPERATORS]
        if unknown:
            raise ValueError(
                f"operators: {unknown} not supported; use some of {', '.join(OPERATORS)}"
            )
        if not 0.0 < self.test_fraction < 1.0:
            raise ValueError(
                f"test_fraction must be strictly between 0 and 1, got {self.test_fraction}"
            )


@attrs.frozen
class Problem:
    operands: tuple[int, ...]
    operators: tuple[str, ...]

    @property
    def expression(self) -> str:
        """`3 + (-4) * 12`: negative operands after the first are parenthesised."""
        parts = [str(self.operands[0])]
        for op, value in zip(self.operators, self.operands[1:], strict=True):
            parts += [op, f"({value})" if value < 0 else str(value)]
        return " ".join(parts)

    @property
    def answer(self) -> Fraction:
        """The value with the usual precedence (* and / before + and -)."""
        total, term = Fraction(0), Fraction(self.operands[0])
        sign = 1
        for op, value in zip(self.operators, self.operands[1:], strict=True):
            if op == "*":
                term *= value
            elif op == "/":
                term /= value
            else:
                total += sign * term
                sign, term = (1 if op == "+" else -1), Fraction(value)
        return total + sign * term

    def canonical(self) -> str:
        """The content key that decides the split; commuted sums and products share one."""
        if len(set(self.operators)) == 1 and self.operators[0] in "+*":
            return f" {self.operators[0]} ".join(str(v) for v in sorted(self.operands))
        return self.expression


def split_of(problem: Problem, test_fraction: float) -> str:
    digest = hashlib.sha256(problem.canonical().encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") < test_fraction * 2**64 else "train"


def _rng(seed: int, split: str, index: int, draw: int) -> random.Random:
    key = hashlib.sha256(f"plait-math/{seed}/{split}/{index}/{draw}".encode()).digest()
    return random.Random(int.from_bytes(key, "big"))


def _operand(rng: random.Random, spec: ProblemSpec) -> int:
    digits = rng.randint(spec.min_digits, spec.max_digits)
    value = rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
    return -value if spec.negatives and value and rng.random() < 0.5 else value


def _divisor(rng: random.Random, running: int, spec: ProblemSpec) -> int:
    """A divisor of the running product within the operand size, so `/` is exact."""
    bound = 10**spec.max_digits - 1
    value = abs(running)
    if value == 0:
        candidates = list(range(1, min(bound, 12) + 1))
    else:
        candidates = [d for d in range(2, min(bound, value, 10_000) + 1) if value % d == 0] or [1]
    divisor = rng.choice(candidates)
    return -divisor if spec.negatives and rng.random() < 0.5 else divisor


def draw_problem(rng: random.Random, spec: ProblemSpec) -> Problem:
    terms = rng.randint(spec.min_terms, spec.max_terms)
    operands = [_operand(rng, spec)]
    operators: list[str] = []
    term = operands[0]  # the running product/quotient chain (an integer: divisions are exact)
    for _ in range(terms - 1):
        op = rng.choice(spec.operators)
        if op == "/":
            value = _divisor(rng, term, spec)
            term //= value
        else:
            value = _operand(rng, spec)
            term = term * value if op == "*" else value
        operators.append(op)
        operands.append(value)
    return Problem(tuple(operands), tuple(operators))


def generate(spec: ProblemSpec, seed: int, split: str, index: int) -> Problem:
    """Problem `index` of `split`: deterministic, and never a problem of the other split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    for draw in range(MAX_DRAWS):
        problem = draw_problem(_rng(seed, split, index, draw), spec)
        if split_of(problem, spec.test_fraction) == split:
            return problem
    raise ValueError(
        f"no {split} problem found in {MAX_DRAWS} draws: the problem space of {spec} is too small "
        "for test_fraction; widen the digits/terms/operators or change test_fraction"
    )
