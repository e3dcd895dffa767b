"""What every math environment shares: a self-contained task, its prompt, and the final answer.

A task is a JSON object that carries its own prompt, expected answer and answer format, so that
an episode can be opened from the task alone (in-process, or over ORS with `task_spec`). The
environment's options decide how tasks are made and how lenient verification is; they are bound
to a subclass made by the factory (`bind`), because the SDK's task methods are classmethods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, ClassVar, Protocol

import attrs

from plait.api import Split
from plait_math.answers import ANSWER_FORMATS, MAX_NUMBER_CHARS, Verdict, format_number, verify
from plait_sdk import Environment, LocalEnvironment, TextBlock, ToolOutput, terminal

TASK_KEYS = ("prompt", "answer", "answer_format")


def parse_expected(text: Any) -> Fraction:
    """A task's expected answer (`8`, `-2.5`, `1/3`); raises ValueError with the cause."""
    if not isinstance(text, str) or not text or len(text) > MAX_NUMBER_CHARS or not text.isascii():
        raise ValueError(f"the task's answer must be a short ASCII number string, got {text!r}")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"the task's answer {text!r} is not a number") from None


def unit_interval(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    """attrs validator: 0 <= value <= 1."""
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{attribute.name} must be between 0 and 1, got {value}")


def make_task(*, prompt: str, answer: Fraction, answer_format: str, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "answer": format_number(answer),
        "answer_format": answer_format,
        **extra,
    }


class MathOptions(Protocol):
    """What the base reads from every math environment's options."""

    @property
    def wrong_format_reward(self) -> float: ...


class GeneratedTasks(Environment):
    """Base of environments whose tasks are made on demand from (split, index) by `make_task`,
    under options bound to the class by `bind`."""

    split_types: ClassVar[Mapping[str, str]] = {"train": "train", "test": "test"}
    options: ClassVar[Any]
    """Bound by `bind`; `split_size` reads its train_size and test_size unless overridden."""

    @classmethod
    def list_splits(cls) -> Sequence[Split]:
        return [Split(name, kind) for name, kind in cls.split_types.items()]  # type: ignore[arg-type]

    @classmethod
    def list_tasks(cls, split: str) -> Sequence[Mapping[str, Any]]:
        return [cls.make_task(split, i) for i in range(cls.split_size(split))]

    @classmethod
    async def num_tasks(cls, split: str) -> int:
        return cls.split_size(split)

    @classmethod
    async def get_task(cls, split: str, index: int) -> Mapping[str, Any]:
        return cls.make_task(split, index)

    @classmethod
    def split_size(cls, split: str) -> int:
        return int(cls.options.train_size if split == "train" else cls.options.test_size)

    @classmethod
    def make_task(cls, split: str, index: int) -> dict[str, Any]:
        raise NotImplementedError


class MathEnvironment(GeneratedTasks):
    """Base: the prompt comes from the task; the final text goes to the `final_answer` terminal
    tool."""

    options: ClassVar[MathOptions]
    """The validated options object, bound by `bind`."""
    robust: ClassVar[bool] = False
    """Read answers robustly (word problems) rather than strictly (arithmetic)."""

    def setup(self) -> None:
        missing = [k for k in TASK_KEYS if k not in self.task_spec]
        if missing:
            raise ValueError(
                f"task is missing {missing}; a {self.name()} task needs the keys {list(TASK_KEYS)}"
            )
        if not isinstance(self.task_spec["prompt"], str):
            raise ValueError(
                f"task prompt must be a string, got {type(self.task_spec['prompt']).__name__}"
            )
        if self.task_spec["answer_format"] not in ANSWER_FORMATS:
            raise ValueError(
                f"task answer_format {self.task_spec['answer_format']!r} is not one of "
                f"{ANSWER_FORMATS}"
            )
        self.expected = parse_expected(self.task_spec["answer"])

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(self.task_spec["prompt"])]

    def judge(self, text: str, answer_format: str) -> ToolOutput:
        """Verify a final answer and end the episode (reward 1.0 or 0.0, unless the options say
        to give credit for a right number in the wrong format)."""
        verdict: Verdict = verify(
            text,
            self.expected,
            answer_format,
            robust=self.robust,
            wrong_format_reward=self.options.wrong_format_reward,
        )
        return ToolOutput(
            blocks=[TextBlock(verdict.feedback())],
            reward=verdict.reward,
            finished=True,
            metadata=verdict.metadata(),
        )

    @terminal
    def final_answer(self, text: str) -> ToolOutput:
        """Receives the model's final reply and checks the answer in it."""
        return self.judge(text, self.task_spec["answer_format"])


def bind(env_cls: type[GeneratedTasks], options: object, name: str) -> LocalEnvironment:
    """A LocalEnvironment over a subclass of `env_cls` with `options` bound."""
    short = name.rsplit(".", 1)[-1]
    bound = type(short, (env_cls,), {"options": options, "__module__": env_cls.__module__})
    return LocalEnvironment(bound, name=name)
