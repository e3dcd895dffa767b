"""math.gsm8k: the real GSM8K test split, the gsm_symbolic train split, and decontamination."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest

from plait.api import build
from plait_math.gsm8k import GSM_SYMBOLIC_SOURCE_ROWS, gsm8k_test_rows, match_template_sources


def env(**options: object):
    return build("env", "math.gsm8k", options=options)


def test_the_test_split_is_all_of_gsm8k_test_with_parsed_answers() -> None:
    rows = gsm8k_test_rows()
    assert len(rows) == 1319
    assert rows[0].answer == 18 and rows[0].question.startswith("Janet’s ducks lay 16 eggs")
    assert all(isinstance(r.answer, Fraction) for r in rows)
    assert any(r.answer >= 1000 for r in rows)  # "#### 1,600"-style answers were parsed
    e = env()
    assert asyncio.run(e.num_tasks("test")) == 1319
    task = asyncio.run(e.get_task("test", 0))
    assert (task["answer"], task["row"], task["source"]) == ("18", 0, "gsm8k test")
    assert task["question"] in task["prompt"] and "#### N" in task["prompt"]


def test_decontaminated_split_leaves_out_the_template_sources() -> None:
    e = env()
    assert len(set(GSM_SYMBOLIC_SOURCE_ROWS)) == 100
    assert asyncio.run(e.num_tasks("test_decontaminated")) == 1219
    rows = {asyncio.run(e.get_task("test_decontaminated", i))["row"] for i in range(0, 1219, 7)}
    assert not rows & set(GSM_SYMBOLIC_SOURCE_ROWS)


@pytest.mark.slow  # imports all of reasoning-gym and compares 100 x 1,319 questions
def test_the_template_source_rows_are_what_the_matcher_finds() -> None:
    assert tuple(match_template_sources()) == GSM_SYMBOLIC_SOURCE_ROWS


def test_train_split_comes_from_gsm_symbolic_seeded() -> None:
    a = [asyncio.run(env(seed=1).get_task("train", i)) for i in range(5)]
    assert a == [asyncio.run(env(seed=1).get_task("train", i)) for i in range(5)]
    assert a != [asyncio.run(env(seed=2).get_task("train", i)) for i in range(5)]
    for task in a:
        assert task["source"] == "reasoning-gym gsm_symbolic"
        assert (
            "Do not include units" not in task["prompt"]
        )  # reasoning-gym's own instruction is replaced
        Fraction(task["answer"])
    assert asyncio.run(env(train_size=50).num_tasks("train")) == 50


def test_answer_format_option_changes_prompt_and_grading() -> None:
    async def grade(fmt: str, text: str) -> float:
        e = env(answer_format=fmt)
        task = await e.get_task("test", 0)  # expected 18
        assert "\\boxed{N}" in task["prompt"] if fmt == "boxed" else True
        session = await e.open(task)
        output = await session.call("final_answer", {"text": text})
        await session.close()
        return output.reward

    assert asyncio.run(grade("boxed", "She makes 9 * 2 = \\boxed{\\$18} a day.")) == 1.0
    assert asyncio.run(grade("hash", "She makes 9 * 2 = \\boxed{\\$18} a day.")) == 0.0
    assert asyncio.run(grade("hash", "9 eggs * $2 = $18\n#### $18.00")) == 1.0
    assert asyncio.run(grade("last_number", "She makes $18 every day.")) == 1.0
