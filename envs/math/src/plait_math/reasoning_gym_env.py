"""`reasoning_gym`: reasoning-gym's procedural datasets, one or a weighted mixture, scored by
reasoning-gym itself.

A split is a reasoning-gym `CompositeDataset` of the chosen datasets (their own config keys, their
weights). The prompt is reasoning-gym's system prompt (it asks for `<answer>...</answer>`) and the
question; the reply's answer is read with reasoning-gym's `extract_answer` (the last answer tag)
and scored by the dataset's own `score_answer`.

Disjoint splits: reasoning-gym draws item i of a dataset seeded s from `Random(s + i)` (a few
datasets draw the whole set from `Random(s)`). The composite seeds its j-th dataset with its own
seed + j + 1, and plait seeds the train composite with `seed` and the test composite with
`seed + train_size`, so train items come from seeds `seed + j + 1 + i` (i < train_size) and test
items from `seed + train_size + j + 1 + i`: the splits never share a random stream. Items can still
coincide in content where a dataset's problem space is small.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from typing import Any, ClassVar

import attrs

from plait.api import positive
from plait_math.base import GeneratedTasks, bind
from plait_sdk import LocalEnvironment, Message, TextBlock, ToolOutput, terminal

REASONING_GYM_VERSION = "0.1.25"
PLAIT_SET = ("seed", "size")  # config keys plait sets from its own options


def _reasoning_gym() -> Any:
    """The reasoning_gym package (importing it registers every dataset: seconds, so only when a
    config selects this environment)."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(
            "reasoning_gym needs the reasoning-gym package, which is not installed: "
            f"pip install reasoning-gym=={REASONING_GYM_VERSION}"
        ) from None
    return reasoning_gym


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f' (did you mean "{close[0]}"?)' if close else ""


@attrs.frozen(kw_only=True)
class DatasetOptions:
    """One dataset of the mixture."""

    weight: float = attrs.field(default=1.0, validator=positive)
    """Its relative share of the tasks."""
    config: dict[str, Any] = attrs.field(factory=dict)
    """The dataset's own config keys (its reasoning-gym config class), but seed and size."""


@attrs.frozen(kw_only=True)
class ReasoningGymOptions:
    """Options of `reasoning_gym`."""

    datasets: dict[str, DatasetOptions]
    """reasoning-gym dataset name -> its weight and config."""
    seed: int = 0
    """Seeds both splits; they stay disjoint for every seed (module docstring)."""
    train_size: int = attrs.field(default=10_000, validator=positive)
    test_size: int = attrs.field(default=500, validator=positive)
    system_prompt: str = "default"
    """A key of reasoning-gym's SYSTEM_PROMPTS (one word), or the system prompt's own text."""
    few_shot: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Worked examples before the question, as earlier chat turns: the first `few_shot` items of
    the train split, each answered `<answer>...</answer>` (a small model learns the format)."""

    def __attrs_post_init__(self) -> None:
        _reasoning_gym()
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if self.system_prompt not in SYSTEM_PROMPTS and re.fullmatch(r"\w+", self.system_prompt):
            raise ValueError(
                f"system_prompt: {self.system_prompt!r} is not one of reasoning-gym's "
                f"SYSTEM_PROMPTS: {', '.join(SYSTEM_PROMPTS)}"
            )
        if not self.datasets:
            raise ValueError("datasets: name at least one reasoning-gym dataset")
        names = sorted(name for name in DATASETS if name != "composite")
        for name, spec in self.datasets.items():
            if name not in names:
                raise ValueError(
                    f"datasets.{name}: not a dataset of reasoning-gym {REASONING_GYM_VERSION}"
                    f"{_did_you_mean(name, names)}; its datasets: {', '.join(names)}"
                )
            config_cls = DATASETS[name][1]
            keys = [f.name for f in dataclasses.fields(config_cls) if f.name not in PLAIT_SET]
            for key in spec.config:
                if key in PLAIT_SET:
                    raise ValueError(
                        f"datasets.{name}.config.{key}: set by plait from the options seed, "
                        "train_size and test_size; leave it out"
                    )
                if key not in keys:
                    raise ValueError(
                        f"datasets.{name}.config.{key}: not a config key of {name} "
                        f"({config_cls.__name__}){_did_you_mean(key, keys)}; its keys: "
                        f"{', '.join(keys)}"
                    )
            try:
                config = config_cls(**spec.config)
                if hasattr(config, "validate"):  # as reasoning-gym's create_dataset does
                    config.validate()
            except (AssertionError, ValueError, TypeError) as exc:
                raise ValueError(
                    f"datasets.{name}.config: reasoning-gym rejects it: {exc}"
                ) from None


class ReasoningGymEnvironment(GeneratedTasks):
    """A reasoning-gym question; the reply's `<answer>` is scored by the dataset's scorer."""

    options: ClassVar[ReasoningGymOptions]

    @classmethod
    @functools.cache
    def mixture(cls, split: str) -> Any:
        """The split's CompositeDataset (made once per bound class and split)."""
        from reasoning_gym.composite import DatasetSpec

        options = cls.options
        return _reasoning_gym().create_dataset(
            "composite",
            size=cls.split_size(split),
            seed=options.seed + (0 if split == "train" else options.train_size),
            datasets=[
                DatasetSpec(name, spec.weight, dict(spec.config))
                for name, spec in options.datasets.items()
            ],
        )

    @classmethod
    def entry(cls, split: str, index: int) -> dict[str, Any]:
        """Item `index` of `split`, as reasoning-gym made it (question, answer, metadata)."""
        if split not in cls.split_types:
            raise KeyError(f"no split {split!r}; the splits are {list(cls.split_types)}")
        if not 0 <= index < cls.split_size(split):
            # beyond the size, indices would reach the other split's seeds
            raise IndexError(f"task index {index} is out of range for split {split!r}")
        entry: dict[str, Any] = cls.mixture(split)[index]
        return entry

    @classmethod
    def make_task(cls, split: str, index: int) -> dict[str, Any]:
        entry = cls.entry(split, index)
        return {
            "question": entry["question"],
            "answer": entry["answer"],
            "dataset": entry["metadata"]["source_dataset"],
            "split": split,
            "index": index,
        }

    def setup(self) -> None:
        # Scored against the entry reasoning-gym makes again, not the task's JSON copy: some
        # scorers (arc_agi, rearc) need their metadata's tuples, which JSON turns into lists.
        split, index = self.task_spec.get("split"), self.task_spec.get("index")
        if not isinstance(split, str) or not isinstance(index, int):
            raise ValueError(f"a {self.name()} task needs its 'split' and 'index'")
        self.item = self.entry(split, index)
        if self.item["question"] != self.task_spec.get("question"):
            raise ValueError(
                f"task {split}[{index}] is not this environment's: it was made with other options"
            )

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(self.item["question"])]

    async def get_messages(self) -> list[Message]:
        from reasoning_gym.utils import SYSTEM_PROMPTS

        prompt = self.options.system_prompt
        shots = [self.entry("train", i) for i in range(self.options.few_shot)]
        return [
            Message("system", SYSTEM_PROMPTS.get(prompt, prompt)),
            *(
                message
                for shot in shots
                for message in (
                    Message("user", shot["question"]),
                    Message("assistant", f"<answer>{shot['answer']}</answer>"),
                )
            ),
            Message("user", self.item["question"]),
        ]

    @terminal
    def final_answer(self, text: str) -> ToolOutput:
        """Receives the model's reply and scores the answer in its last <answer> tag."""
        from reasoning_gym.utils import extract_answer

        dataset = self.item["metadata"]["source_dataset"]
        extracted = extract_answer(text)
        metadata: dict[str, Any] = {"dataset": dataset, "extracted": extracted}
        try:
            reward = float(self.mixture(self.task_spec["split"]).score_answer(extracted, self.item))
        except Exception as exc:  # a few scorers raise on malformed answers: those are wrong
            reward, metadata = 0.0, {**metadata, "scorer_error": f"{type(exc).__name__}: {exc}"}
        feedback = (
            "no <answer>...</answer> tag found"
            if extracted is None
            else f"answer {extracted!r} scored {reward:g}"
        )
        return ToolOutput(
            blocks=[TextBlock(feedback)], reward=reward, finished=True, metadata=metadata
        )


def make_env(*, options: ReasoningGymOptions) -> LocalEnvironment:
    return bind(ReasoningGymEnvironment, options, "reasoning_gym")
