"""`math.arith`: seeded arithmetic with difficulty knobs and a strict verifier.

Options start from a preset; every knob given explicitly overrides the preset's value:

    [env]
    name = "math.arith"
    options = { preset = "smollm", answer_format = "boxed", max_digits = 2 }
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import attrs

from plait.api import Message, ToolOutput, positive
from plait_math.answers import FORMAT_INSTRUCTIONS, AnswerFormat, format_number
from plait_math.base import MathEnvironment, bind, make_task, unit_interval
from plait_math.problems import Problem, ProblemSpec, generate
from plait_sdk import LocalEnvironment

PromptStyle = Literal["instruct", "bare"]
# How a worked example's answer is written in each format.
EXAMPLE_ANSWERS = {
    "plain": "{}",
    "last_number": "{}",
    "boxed": "\\boxed{{{}}}",
    "answer_tag": "<answer>{}</answer>",
    "hash": "#### {}",
}


def format_answer(answer: Any, answer_format: str) -> str:
    """`answer` written as a worked example writes it in `answer_format`."""
    return EXAMPLE_ANSWERS[answer_format].format(format_number(answer))


# Each preset fixes every knob; see the README for what each is for and how it was measured.
ARITH_PRESETS: dict[str, dict[str, Any]] = {
    # SmolLM2-135M-Instruct's demo task: a+b after three worked examples as earlier chat turns; it
    # answers a bare number from the start (greedy ~0.2 right), so GRPO lifts accuracy in minutes.
    "sums": dict(
        min_digits=1,
        max_digits=1,
        min_terms=2,
        max_terms=2,
        operators=["+"],
        negatives=False,
        answer_format="plain",
        prompt_style="bare",
        shots=3,
    ),
    # A random-init ~10M model trained for minutes: single-digit a+b, prompt "3 + 5 =", bare number.
    "tiny": dict(
        min_digits=1,
        max_digits=1,
        min_terms=2,
        max_terms=2,
        operators=["+"],
        negatives=False,
        answer_format="plain",
        prompt_style="bare",
    ),
    # Harder for SmolLM2-135M-Instruct: about a third right at first (README), little learnt in
    # 40 steps.
    "smollm": dict(
        min_digits=1,
        max_digits=1,
        min_terms=2,
        max_terms=3,
        operators=["+", "-"],
        negatives=False,
        answer_format="last_number",
        prompt_style="instruct",
    ),
    "default": dict(
        min_digits=1,
        max_digits=2,
        min_terms=2,
        max_terms=3,
        operators=["+", "-", "*"],
        negatives=False,
        answer_format="answer_tag",
        prompt_style="instruct",
    ),
    "hard": dict(
        min_digits=2,
        max_digits=3,
        min_terms=3,
        max_terms=5,
        operators=["+", "-", "*", "/"],
        negatives=True,
        answer_format="answer_tag",
        prompt_style="instruct",
    ),
}


@attrs.frozen(kw_only=True)
class ArithOptions:
    """Options of `math.arith`. Knobs left unset (None) take the preset's value."""

    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = ARITH_PRESETS

    preset: str = "default"
    seed: int = 0
    """Seeds the task streams; train and test stay disjoint for every seed."""
    min_digits: int | None = None
    max_digits: int | None = None
    """Digits per operand (1 = 0..9)."""
    min_terms: int | None = None
    max_terms: int | None = None
    operators: list[str] | None = None
    """Some of "+", "-", "*", "/" (division is always exact)."""
    negatives: bool | None = None
    """Allow negative operands."""
    answer_format: AnswerFormat | None = None
    prompt_style: PromptStyle | None = None
    """instruct: "What is 3 + 5? <format instruction>"; bare: "3 + 5 =" (for tiny models)."""
    shots: int | None = None
    """Worked examples (question, answer in the format) as earlier chat turns before the question;
    the same for every task, so prompts share them as a common prefix."""
    wrong_format_reward: float = attrs.field(default=0.0, validator=unit_interval)
    """Reward for the right number in the wrong format (0 = strict)."""
    test_fraction: float = 0.2
    """Share of the problem space that belongs to the test split."""
    train_size: int = attrs.field(default=100_000, validator=positive)
    test_size: int = attrs.field(default=1_000, validator=positive)
    verify_seconds: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    """How long checking an answer takes, on purpose: stands in for a slow verifier (a test suite,
    a judge model) when measuring how rollout capacity scales (benchmarks/rollout_scaling.py)."""

    def __attrs_post_init__(self) -> None:
        if self.preset not in self.PRESETS:
            raise ValueError(f"preset {self.preset!r} is not one of {', '.join(self.PRESETS)}")
        if self.knob("shots") < 0:
            raise ValueError(f"shots must be >= 0, got {self.knob('shots')}")
        if self.knob("prompt_style") == "bare" and self.knob("answer_format") not in (
            "plain",
            "last_number",
        ):
            raise ValueError(
                f"prompt_style 'bare' tells the model no answer format, so answer_format must be "
                f"'plain' or 'last_number', not {self.knob('answer_format')!r}"
            )
        self.problem_spec().check()

    def knob(self, name: str) -> Any:
        value = getattr(self, name)
        return self.PRESETS[self.preset].get(name, 0) if value is None else value

    def problem_spec(self) -> ProblemSpec:
        return ProblemSpec(
            min_digits=self.knob("min_digits"),
            max_digits=self.knob("max_digits"),
            min_terms=self.knob("min_terms"),
            max_terms=self.knob("max_terms"),
            operators=tuple(self.knob("operators")),
            negatives=self.knob("negatives"),
            test_fraction=self.test_fraction,
        )


class ArithEnvironment(MathEnvironment):
    """Compute an arithmetic expression; answer in the format the prompt asks for."""

    options: ClassVar[ArithOptions]

    @classmethod
    def prompt_for(cls, problem: Problem, answer_format: str) -> str:
        if cls.options.knob("prompt_style") == "bare":
            return f"{problem.expression} ="
        return f"What is {problem.expression}? {FORMAT_INSTRUCTIONS[answer_format]}"

    @classmethod
    def worked_examples(cls) -> list[Message]:
        """`shots` question/answer turns, from a stream of train problems no task index reaches."""
        turns = []
        answer_format = cls.options.knob("answer_format")
        for i in range(cls.options.knob("shots")):
            problem = generate(cls.options.problem_spec(), cls.options.seed, "train", -1 - i)
            turns += [
                Message("user", cls.prompt_for(problem, answer_format)),
                *cls.worked_answer(problem, answer_format, i),
            ]
        return turns

    @classmethod
    def worked_answer(cls, problem: Problem, answer_format: str, shot: int) -> list[Message]:
        """How worked example `shot` is answered: the number in the format."""
        return [Message("assistant", format_answer(problem.answer, answer_format))]

    async def get_messages(self) -> list[Message]:
        return [*self.worked_examples(), *await super().get_messages()]

    def judge(self, text: str, answer_format: str) -> ToolOutput:
        if self.options.verify_seconds:
            time.sleep(
                self.options.verify_seconds
            )  # a slow verifier, on purpose (options.verify_seconds)
        return super().judge(text, answer_format)

    @classmethod
    def make_task(cls, split: str, index: int) -> dict[str, Any]:
        problem = generate(cls.options.problem_spec(), cls.options.seed, split, index)
        answer_format = cls.options.knob("answer_format")
        return make_task(
            prompt=cls.prompt_for(problem, answer_format),
            answer=problem.answer,
            answer_format=answer_format,
            split=split,
            index=index,
            expression=problem.expression,
        )


def make_env(*, options: ArithOptions) -> LocalEnvironment:
    return bind(ArithEnvironment, options, "math.arith")
