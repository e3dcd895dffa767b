"""Countdown: reach the target number from the given numbers with + - * / (each at most once).

A task is made from (options.seed, split, index) and carries all an episode needs. Its target
combines all its numbers (`solution`, not shown to the model), so every task can be solved."""

from __future__ import annotations

import ast
import operator
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Any, ClassVar

import attrs

from plait.api import positive
from plait_sdk import Environment, LocalEnvironment, Split, TextBlock, ToolOutput, terminal, tool

_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@attrs.frozen
class CountdownOptions:
    numbers: int = attrs.field(
        default=4, validator=[positive, attrs.validators.le(6)]
    )  # numbers per task
    max_number: int = attrs.field(
        default=20, validator=positive
    )  # numbers are drawn from 1..max_number
    train_size: int = attrs.field(default=1000, validator=positive)
    test_size: int = attrs.field(default=100, validator=positive)
    seed: int = 0


def make_task(options: CountdownOptions, split: str, index: int) -> dict[str, Any]:
    rng = random.Random(f"{options.seed}/{split}/{index}")
    numbers = [rng.randint(1, options.max_number) for _ in range(options.numbers)]
    expression, value = str(numbers[0]), numbers[0]
    for n in numbers[1:]:
        op = rng.choice(["+", "-", "*", "/"] if value % n == 0 else ["+", "-", "*"])
        op = "+" if op == "-" and value - n <= 0 else op  # keep every step a positive whole number
        expression, value = f"({expression} {op} {n})", int(_APPLY[op](Fraction(value), n))
    return {"numbers": numbers, "target": value, "solution": expression}


def value_of(node: ast.AST, used: list[int]) -> Fraction:
    """The exact value of whole numbers, + - * / and parentheses (the numbers go to `used`)."""
    if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOL:
        left, right = value_of(node.left, used), value_of(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _APPLY[_SYMBOL[type(node.op)]](left, right)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError(
        f"only whole numbers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}"
    )


class Countdown(Environment):
    """Reach the target with the given numbers; the reply is judged by the `answer` terminal
    tool."""

    options: ClassVar[CountdownOptions] = CountdownOptions()
    reward_range = (0.0, 1.0)

    @classmethod
    def list_splits(cls) -> list[Split]:
        return [Split("train", "train"), Split("test", "test")]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict[str, Any]]:
        return [
            make_task(cls.options, split, i) for i in range(getattr(cls.options, f"{split}_size"))
        ]

    @classmethod
    async def num_tasks(cls, split: str) -> int:  # procedural: no need to build every task
        return int(getattr(cls.options, f"{split}_size"))

    @classmethod
    async def get_task(cls, split: str, index: int) -> dict[str, Any]:
        return make_task(cls.options, split, index)

    def setup(self) -> None:
        if not (
            isinstance(self.task_spec.get("numbers"), list)
            and type(self.task_spec.get("target")) is int
        ):
            raise ValueError(
                "a countdown task needs 'numbers' (a list of whole numbers) and 'target' "
                "(a whole number)"
            )

    def get_prompt(self) -> list[TextBlock]:
        numbers, target = ", ".join(map(str, self.task_spec["numbers"])), self.task_spec["target"]
        return [
            TextBlock(
                f"Using the numbers {numbers}, each at most once, and + - * / with parentheses, "
                f"write an expression equal to {target}. Reply with the expression alone on the "
                "last line."
            )
        ]

    @terminal
    @tool
    def answer(self, text: str) -> ToolOutput:
        """Judge the expression on the reply's last line (a trailing "= N" is ignored)."""
        expression = (
            re.sub(r"=.*$", "", (text.strip().splitlines() or [""])[-1]).strip().strip("`$")
        )
        used: list[int] = []
        try:
            if len(expression) > 200:
                raise ValueError("the expression is longer than 200 characters")
            value = value_of(ast.parse(expression, mode="eval").body, used)
            if Counter(used) - Counter(self.task_spec["numbers"]):
                raise ValueError(
                    f"it uses numbers that were not given (or one twice): {sorted(used)}"
                )
        except (SyntaxError, ValueError) as exc:
            reason = (
                f"{expression!r} is not an arithmetic expression"
                if isinstance(exc, SyntaxError)
                else exc
            )
            return ToolOutput(
                blocks=[TextBlock(f"Invalid: {reason}.")],
                reward=0.0,
                finished=True,
                metadata={"valid": False},
            )
        correct = value == self.task_spec["target"]
        verdict = (
            "Correct"
            if correct
            else f"Wrong: {expression} = {value}, not {self.task_spec['target']}"
        )
        return ToolOutput(
            blocks=[TextBlock(verdict + ".")],
            reward=float(correct),
            finished=True,
            metadata={"valid": True, "correct": correct},
        )


def make_env(*, options: CountdownOptions) -> LocalEnvironment:
    """The factory plait calls (`env.name = "countdown"`): the class with `options` bound to it."""
    bound = type("Countdown", (Countdown,), {"options": options, "__module__": __name__})
    return LocalEnvironment(bound, name="countdown")
