"""The verifier: a table of tricky model outputs, and properties that hold for any text."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from plait_math.answers import (
    ANSWER_FORMATS,
    format_number,
    parse_number,
    parse_number_robust,
    verify,
)

F = Fraction

# (text, format, expected, reward, format_followed) -- strict (arithmetic) verification.
STRICT_CASES = [
    ("42", "plain", 42, 1.0, True),
    ("  42\n", "plain", 42, 1.0, True),
    ("+42", "plain", 42, 1.0, True),
    ("42.0", "plain", 42, 1.0, True),
    ("042", "plain", 42, 1.0, True),
    ("1,234", "plain", 1234, 1.0, True),
    ("-7", "plain", -7, 1.0, True),
    ("-7", "plain", 7, 0.0, True),
    ("43", "plain", 42, 0.0, True),
    ("42.", "plain", 42, 0.0, False),  # strict: a trailing period is not "only the number"
    ("The answer is 42", "plain", 42, 0.0, False),
    ("2 + 40 = 42", "plain", 42, 0.0, False),
    ("42 42", "plain", 42, 0.0, False),
    ("1,23", "plain", 123, 0.0, False),
    ("12,3456", "plain", 123456, 0.0, False),
    ("", "plain", 0, 0.0, False),
    ("   ", "plain", 0, 0.0, False),
    ("٤٢", "plain", 42, 0.0, False),  # Arabic-Indic digits: only ASCII digits count
    ("４２", "plain", 42, 0.0, False),  # full-width digits
    ("4\u200b2", "plain", 42, 0.0, False),  # zero-width space inside
    ("forty-two", "plain", 42, 0.0, False),
    ("1e3", "plain", 1000, 0.0, False),
    ("0x2A", "plain", 42, 0.0, False),
    ("nan", "plain", 0, 0.0, False),
    ("2 + 40 = 42", "last_number", 42, 1.0, True),
    ("The answer is 42.", "last_number", 42, 1.0, True),
    ("42 apples, no wait, 41", "last_number", 42, 0.0, True),
    ("5 - 7 = -2", "last_number", -2, 1.0, True),
    ("7-2", "last_number", 2, 1.0, True),  # a binary minus is not a sign
    ("no digits here", "last_number", 1, 0.0, False),
    ("\\boxed{42}", "boxed", 42, 1.0, True),
    ("So \\boxed{ 42 } is it.", "boxed", 42, 1.0, True),
    ("\\boxed{42} and \\boxed{42}", "boxed", 42, 0.0, False),  # exactly one answer
    ("\\boxed{41} then \\boxed{42}", "boxed", 42, 0.0, False),
    ("\\boxed{42", "boxed", 42, 0.0, False),
    ("\\boxed{}", "boxed", 0, 0.0, False),
    ("\\boxed{x = 42}", "boxed", 42, 0.0, False),  # strict: the box holds only a number
    ("\\boxed{\\boxed{42}}", "boxed", 42, 0.0, False),
    ("boxed{42}", "boxed", 42, 0.0, False),
    ("42", "boxed", 42, 0.0, False),
    ("<answer>42</answer>", "answer_tag", 42, 1.0, True),
    ("Thinking... <answer> 42 </answer>", "answer_tag", 42, 1.0, True),
    ("<answer>41</answer>", "answer_tag", 42, 0.0, True),
    ("<answer><answer>42</answer></answer>", "answer_tag", 42, 0.0, False),  # nested tags
    ("<answer>42</answer><answer>42</answer>", "answer_tag", 42, 0.0, False),
    ("</answer>42<answer>", "answer_tag", 42, 0.0, False),
    ("<answer>42", "answer_tag", 42, 0.0, False),
    ("<ANSWER>42</ANSWER>", "answer_tag", 42, 0.0, False),
    ("<answer></answer>", "answer_tag", 42, 0.0, False),
    ("<answer>42 apples</answer>", "answer_tag", 42, 0.0, False),
    ("#### 42", "hash", 42, 1.0, True),
    ("work\n#### 42\n", "hash", 42, 1.0, True),
    ("#### 41\n#### 42", "hash", 42, 1.0, True),  # the last #### line counts
    ("####", "hash", 42, 0.0, False),
]

# Robust (word-problem) verification: units, currency, separators, LaTeX, fractions.
ROBUST_CASES = [
    ("#### $1,234.00", "hash", 1234, 1.0, True),
    ("#### 18 dollars.", "hash", 18, 1.0, True),
    ("#### 18.", "hash", 18, 1.0, True),
    ("####18", "hash", 18, 1.0, True),
    ("#### -3", "hash", -3, 1.0, True),
    ("#### 0.5", "hash", F(1, 2), 1.0, True),
    ("#### 1/2", "hash", F(1, 2), 1.0, True),
    ("#### 36/2", "hash", 18, 1.0, True),
    ("#### 25%", "hash", 25, 1.0, True),
    ("#### 1,600 people", "hash", 1600, 1.0, True),
    ("#### 1687.50", "hash", F(3375, 2), 1.0, True),
    ("#### 10 - 3 = 7", "hash", 7, 1.0, True),
    ("#### seven", "hash", 7, 0.0, False),
    ("\\boxed{\\$18}", "boxed", 18, 1.0, True),
    ("\\boxed{\\frac{36}{2}}", "boxed", 18, 1.0, True),
    ("\\boxed{\\dfrac{1}{3}}", "boxed", F(1, 3), 1.0, True),
    ("\\boxed{18\\text{ dollars}}", "boxed", 18, 1.0, True),
    ("\\boxed{1{,}000}", "boxed", 1000, 0.0, True),  # LaTeX thousands group is read as 1 and 000
    ("<answer>$5.00</answer>", "answer_tag", 5, 1.0, True),
    ("<answer>\n5\n</answer>", "answer_tag", 5, 1.0, True),
    ("She has 5 apples. The answer is 18", "hash", 18, 0.0, False),
]


@pytest.mark.parametrize(("text", "fmt", "expected", "reward", "followed"), STRICT_CASES)
def test_strict_verifier_table(
    text: str, fmt: str, expected: int, reward: float, followed: bool
) -> None:
    verdict = verify(text, F(expected), fmt)
    assert (verdict.reward, verdict.format_followed) == (reward, followed), verdict
    assert verdict.correct == (reward == 1.0)


@pytest.mark.parametrize(("text", "fmt", "expected", "reward", "followed"), ROBUST_CASES)
def test_robust_verifier_table(
    text: str, fmt: str, expected: Fraction, reward: float, followed: bool
) -> None:
    verdict = verify(text, F(expected), fmt, robust=True)
    assert (verdict.reward, verdict.format_followed) == (reward, followed), verdict


def test_wrong_format_credit_only_when_an_option_gives_it() -> None:
    assert verify("2 + 40 = 42", F(42), "answer_tag").reward == 0.0
    partial = verify("2 + 40 = 42", F(42), "answer_tag", wrong_format_reward=0.5)
    assert (partial.reward, partial.correct, partial.format_followed) == (0.5, False, False)
    assert "wrong format" in partial.reason
    # a wrong number in the wrong format earns nothing either way
    assert verify("2 + 40 = 41", F(42), "answer_tag", wrong_format_reward=0.5).reward == 0.0
    # a wrong number in the right format is wrong: the fallback does not rescue it
    assert (
        verify("42 <answer>41</answer>", F(42), "answer_tag", wrong_format_reward=1.0).reward == 0.0
    )


def test_metadata_names_extracted_expected_and_format() -> None:
    metadata = verify("<answer>41</answer> or 42", F(42), "answer_tag").metadata()
    assert metadata["extracted"] == "41"
    assert metadata["expected"] == "42"
    assert metadata["format_followed"] is True
    assert metadata["last_number"] == "42"
    assert metadata["correct"] is False
    missing = verify("no answer", F(42), "boxed").metadata()
    assert missing["extracted"] is None and missing["format_followed"] is False


def test_non_text_answers_are_rejected_not_raised() -> None:
    for value in (None, 42, ["42"], {"a": 1}, b"42"):
        verdict = verify(value, F(42), "plain")
        assert verdict.reward == 0.0 and "not text" in verdict.reason


def test_huge_and_pathological_outputs() -> None:
    cases = [
        "9" * 100_000,  # a number too long to convert is refused, not parsed
        "<answer>" + "9" * 100_000 + "</answer>",
        "\\boxed{" * 50_000,
        "{" * 100_000 + "\\boxed{42" + "}" * 10,
        "<answer>" * 10_000 + "42" + "</answer>" * 10_000,
        "1," * 100_000,
        "-" * 100_000 + "5",
        ("1/" * 50_000) + "2",
        "\\frac{" * 20_000,
        "#" * 100_000,
        "\x00\ud800\U0010ffff" * 1000,
        "1.2.3.4.5.6.7",
    ]
    for text in cases:
        for fmt in ANSWER_FORMATS:
            for robust in (False, True):
                verdict = verify(text, F(42), fmt, robust=robust)
                assert verdict.reward in (0.0, 1.0)
    assert verify("<answer>" + "9" * 100_000 + "</answer>", F(9), "answer_tag").reward == 0.0


def test_parse_number_and_format_number() -> None:
    assert parse_number("1,234.50") == F(246_9, 2)
    assert parse_number("1,2,3") is None
    assert parse_number("9" * 201) is None
    assert parse_number_robust("costs $3.50 each, total $7") == 7
    assert parse_number_robust("-.5") == F(-1, 2)
    assert parse_number_robust("a/b") is None
    assert parse_number_robust("1/0") == 0  # no fraction: the last number (0) is read
    assert [format_number(F(x)) for x in ("8", "-2.5", "1/3", "1/8", "100")] == [
        "8",
        "-2.5",
        "1/3",
        "0.125",
        "100",
    ]


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(max_size=300),
    fmt=st.sampled_from(ANSWER_FORMATS),
    robust=st.booleans(),
    expected=st.fractions(max_denominator=1000),
)
def test_verifier_never_raises(text: str, fmt: str, robust: bool, expected: Fraction) -> None:
    verdict = verify(text, expected, fmt, robust=robust, wrong_format_reward=0.25)
    assert verdict.reward in (0.0, 0.25, 1.0)
    assert verdict.correct == (verdict.reward == 1.0)


MARKUP = st.sampled_from(
    [
        "<answer>",
        "</answer>",
        "\\boxed{",
        "{",
        "}",
        "####",
        "$",
        ",",
        ".",
        "-",
        "/",
        "\\frac{",
        "\n",
        " ",
        "1",
        "42",
        "0",
        "9999999",
        "٣",
        "e",
        "%",
    ]
)


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(MARKUP, max_size=40), fmt=st.sampled_from(ANSWER_FORMATS), robust=st.booleans()
)
def test_verifier_never_raises_on_answer_like_markup(
    parts: list[str], fmt: str, robust: bool
) -> None:
    verify("".join(parts), F(42), fmt, robust=robust)


@settings(max_examples=100, deadline=None)
@given(
    value=st.integers(min_value=-(10**15), max_value=10**15), fmt=st.sampled_from(ANSWER_FORMATS)
)
def test_a_well_formatted_right_answer_always_wins(value: int, fmt: str) -> None:
    text = {
        "plain": f"{value}",
        "last_number": f"so it is {value}",
        "boxed": f"\\boxed{{{value}}}",
        "answer_tag": f"<answer>{value}</answer>",
        "hash": f"steps\n#### {value}",
    }[fmt]
    assert verify(text, F(value), fmt).reward == 1.0
    assert verify(text, F(value + 1), fmt).reward == 0.0
