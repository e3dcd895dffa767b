"""`math.calculator`: harder arithmetic, with a `calculator` tool the model may call any number of
times (up to `max_calculator_calls`) before it answers, either in plain text (the terminal tool
`final_answer`, in the configured answer format) or with the `answer` tool (a bare number)."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from plait.api import Message, ToolCall
from plait_math.answers import FORMAT_INSTRUCTIONS
from plait_math.arith import ArithEnvironment, ArithOptions, format_answer
from plait_math.base import bind
from plait_math.calculator import CalculatorError, evaluate, format_result
from plait_math.problems import Problem
from plait_sdk import LocalEnvironment, TextBlock, ToolOutput, tool

CALCULATOR_PRESETS: dict[str, dict[str, Any]] = {
    # Products of 2-3 digit numbers inside a sum: tedious by hand, one or two tool calls each.
    "default": dict(
        min_digits=2,
        max_digits=3,
        min_terms=3,
        max_terms=4,
        operators=["+", "-", "*"],
        negatives=False,
        answer_format="answer_tag",
        prompt_style="instruct",
    ),
    "hard": dict(
        min_digits=3,
        max_digits=4,
        min_terms=4,
        max_terms=6,
        operators=["+", "-", "*", "/"],
        negatives=True,
        answer_format="answer_tag",
        prompt_style="instruct",
    ),
}


@attrs.frozen(kw_only=True)
class CalculatorOptions(ArithOptions):
    """Options of `math.calculator`: those of `math.arith`, other presets, and a call budget."""

    PRESETS: ClassVar = CALCULATOR_PRESETS

    preset: str = "default"
    max_calculator_calls: int = 16
    """Calculator calls allowed per episode; later calls return a tool error."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.knob("prompt_style") == "bare":
            raise ValueError(
                "prompt_style 'bare' cannot explain the calculator tool; use 'instruct'"
            )
        if self.max_calculator_calls < 0:
            raise ValueError(f"max_calculator_calls must be >= 0, got {self.max_calculator_calls}")


class CalculatorEnvironment(ArithEnvironment):
    """Compute an arithmetic expression, with a calculator tool at hand."""

    options: ClassVar[CalculatorOptions]

    @classmethod
    def prompt_for(cls, problem: Problem, answer_format: str) -> str:
        return (
            f"Compute {problem.expression}. You may call the calculator tool as often as you need. "
            f"When you are done, reply with the result. {FORMAT_INSTRUCTIONS[answer_format]}"
        )

    @classmethod
    def worked_answer(cls, problem: Problem, answer_format: str, shot: int) -> list[Message]:
        """A worked example calls the calculator on the whole expression, then answers with its
        result: a small model copies the pattern (a tool-call format its chat template writes)."""
        call = ToolCall("calculator", {"expression": problem.expression}, id=f"example_{shot}")
        return [
            Message("assistant", tool_calls=[call]),
            Message("tool", format_result(evaluate(problem.expression)), tool_call_id=call.id),
            Message("assistant", format_answer(problem.answer, answer_format)),
        ]

    def setup(self) -> None:
        super().setup()
        self.calculator_calls = 0

    @tool
    def calculator(self, expression: str) -> ToolOutput:
        """Evaluate an arithmetic expression exactly: numbers, + - * / ** (or ^) and parentheses."""
        # A bad or too large expression raises CalculatorError; the session hands its message
        # back to the model as a tool error, and the episode goes on.
        self.calculator_calls += 1
        if self.calculator_calls > self.options.max_calculator_calls:
            raise CalculatorError(
                f"the calculator may be called {self.options.max_calculator_calls} times per "
                "task; give your answer now"
            )
        return ToolOutput(blocks=[TextBlock(format_result(evaluate(expression)))])

    @tool
    def answer(self, answer: str) -> ToolOutput:
        """Submit the final answer as a bare number; this ends the task."""
        return self.judge(answer, "plain")


def make_env(*, options: CalculatorOptions) -> LocalEnvironment:
    return bind(CalculatorEnvironment, options, "math.calculator")
