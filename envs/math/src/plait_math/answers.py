"""Answer formats, number parsing and the verifier shared by every math environment.

A model's final text is checked in two steps: find the *one* answer in the required format
(`extract`), then compare it with the expected value by exact rational equality (`verify`).

Two parsing levels:

- strict (arithmetic): the marked answer must be a plain number and nothing else, e.g. `42`,
  `-7`, `1,234`, `3.50`;
- robust (word problems): inside the marked answer, currency signs, thousands separators, units,
  a trailing period, LaTeX wrappers and fractions are tolerated; the last number there counts.

Only ASCII digits count (Python's `\\d` and `int()` would also accept Arabic-Indic or full-width
digits). Numbers longer than `MAX_NUMBER_CHARS` are refused rather than converted, so no model
output can make the verifier slow or raise; `verify` never raises on any text.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Literal

import attrs

AnswerFormat = Literal["plain", "last_number", "boxed", "answer_tag", "hash"]
ANSWER_FORMATS: tuple[str, ...] = ("plain", "last_number", "boxed", "answer_tag", "hash")

# Longest number string (sign, digits, separators) that is converted. Python refuses to parse
# int strings of more than 4,300 digits anyway; answers here have a few dozen at most.
MAX_NUMBER_CHARS = 200

FORMAT_INSTRUCTIONS: dict[str, str] = {
    "plain": "Reply with only the final answer as a number, and nothing else.",
    "last_number": "End your reply with the final answer as a number.",
    "boxed": "Write the final answer as \\boxed{N}, where N is a number.",
    "answer_tag": (
        "Write the final answer between answer tags, as <answer>N</answer>, where N is a number."
    ),
    "hash": "Write the final answer on its own last line as #### N, where N is a number.",
}

_INTEGER = r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)"
_DECIMAL = rf"{_INTEGER}(?:\.[0-9]+)?"
_STRICT_NUMBER = re.compile(rf"[+-]?{_DECIMAL}")
# A number inside free text: a minus sign counts only where it cannot be a binary minus.
_TEXT_NUMBER = re.compile(rf"(?:(?<![0-9A-Za-z)\]])-)?(?<![0-9.,])(?:{_DECIMAL}|\.[0-9]+)(?![0-9])")
_TEXT_FRACTION = re.compile(
    rf"(?:(?<![0-9A-Za-z)\]])-)?(?<![0-9.,])({_DECIMAL})\s*/\s*({_DECIMAL})(?![0-9])"
)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*(-?[0-9.,]+)\s*\}\s*\{\s*(-?[0-9.,]+)\s*\}")
_LATEX_NOISE = re.compile(r"\\text\{[^{}]*\}|\\mathrm\{[^{}]*\}|\\[,;:!]|\\\$|\\left|\\right|\$")
_DIGIT_COMMA = re.compile(r"(?<=[0-9]),(?=[0-9]{3}(?![0-9]))")

BOXED_OPEN = "\\boxed{"
TAG_OPEN, TAG_CLOSE = "<answer>", "</answer>"
HASH_MARK = "####"


def parse_number(text: str) -> Fraction | None:
    """A strict number (`-12`, `1,234`, `3.50`, `+7`) as an exact Fraction, else None."""
    text = text.strip()
    if not text or len(text) > MAX_NUMBER_CHARS or not _STRICT_NUMBER.fullmatch(text):
        return None
    return Fraction(text.replace(",", ""))


def parse_number_robust(text: str) -> Fraction | None:
    """The last number in a short answer span, tolerating `$`, units, commas, LaTeX, fractions.

    `$1,234.00` -> 1234, `18 dollars.` -> 18, `\\frac{36}{2}` -> 18, `3/4` -> 3/4, `-5` -> -5.
    """
    if len(text) > 10 * MAX_NUMBER_CHARS:  # the answer is at the end; keep the work bounded
        text = text[-10 * MAX_NUMBER_CHARS :]
    text = _LATEX_FRAC.sub(r"\1/\2", text)
    text = _LATEX_NOISE.sub(" ", text)
    text = _DIGIT_COMMA.sub("", text)
    best: tuple[int, Fraction] | None = None
    for match in _TEXT_FRACTION.finditer(text):
        value = _fraction(match.group(1), match.group(2), negative=match.group(0).startswith("-"))
        if value is not None and (best is None or match.end() >= best[0]):
            best = (match.end(), value)
    for match in _TEXT_NUMBER.finditer(text):
        if best is not None and match.end() <= best[0]:
            continue  # part of the fraction already taken
        value = _number(match.group(0))
        if value is not None:
            best = (match.end(), value)
    return best[1] if best else None


def _number(token: str) -> Fraction | None:
    if len(token) > MAX_NUMBER_CHARS:
        return None
    token = token.replace(",", "")
    if token.startswith((".", "-.")):
        token = token.replace(".", "0.", 1)
    try:
        return Fraction(token)
    except ValueError:  # the patterns only pass well-formed numbers; this is a second guard
        return None


def _fraction(numerator: str, denominator: str, *, negative: bool) -> Fraction | None:
    top, bottom = _number(numerator), _number(denominator)
    if top is None or bottom is None or bottom == 0:
        return None
    return -top / bottom if negative else top / bottom


def format_number(value: Fraction) -> str:
    """A Fraction as the shortest exact text: `8`, `-2.5`, `1/3`."""
    if value.denominator == 1:
        return str(value.numerator)
    denominator = value.denominator
    for prime in (2, 5):
        while denominator % prime == 0:
            denominator //= prime
    if denominator == 1:  # a finite decimal
        places = 0
        while (value * 10**places).denominator != 1:
            places += 1
        digits = str(abs(value * 10**places).numerator).rjust(places + 1, "0")
        return f"{'-' if value < 0 else ''}{digits[:-places]}.{digits[-places:]}"
    return f"{value.numerator}/{value.denominator}"


# ---------------------------------------------------------------------------------------------
# Finding the marked answer
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class Marked:
    """The answer span a format marks, or why there is none."""

    span: str | None
    problem: str = ""


_BRACE = re.compile(r"[{}]")


def _boxed_span(text: str, start: int) -> str | None:
    """The brace-balanced content of the `\\boxed{` at `start`, or None if it never closes."""
    depth = 1
    for brace in _BRACE.finditer(text, start + len(BOXED_OPEN)):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[start + len(BOXED_OPEN) : brace.start()]
    return None


def find_marked(text: str, answer_format: str) -> Marked:
    """The span holding the answer in `answer_format`; exactly one marker is required."""
    if answer_format == "plain":
        return Marked(text.strip()) if text.strip() else Marked(None, "the reply is empty")
    if answer_format == "last_number":
        return Marked(text)
    if answer_format == "boxed":
        count = text.count(BOXED_OPEN)
        if count != 1:
            return Marked(None, f"expected exactly one \\boxed{{}}, found {count}")
        span = _boxed_span(text, text.index(BOXED_OPEN))
        return Marked(span) if span is not None else Marked(None, "\\boxed{ is never closed")
    if answer_format == "answer_tag":
        opens, closes = text.count(TAG_OPEN), text.count(TAG_CLOSE)
        if opens != 1 or closes != 1:
            return Marked(
                None,
                f"expected exactly one {TAG_OPEN}...{TAG_CLOSE}, found {opens} opening and "
                f"{closes} closing tags",
            )
        start, end = text.index(TAG_OPEN) + len(TAG_OPEN), text.index(TAG_CLOSE)
        if end < start:
            return Marked(None, f"{TAG_CLOSE} comes before {TAG_OPEN}")
        return Marked(text[start:end])
    if answer_format == "hash":
        at = text.rfind(HASH_MARK)
        if at == -1:
            return Marked(None, f"no {HASH_MARK} line")
        return Marked(text[at + len(HASH_MARK) :].split("\n", 1)[0])
    raise ValueError(f"unknown answer format {answer_format!r}; expected one of {ANSWER_FORMATS}")


# ---------------------------------------------------------------------------------------------
# The verdict
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class Verdict:
    """What the verifier decided about one final answer.

    `extracted` is the answer found in the required format (None when the format was not
    followed); `last_number` is the last number anywhere in the text, for diagnostics and for
    the optional wrong-format credit.
    """

    reward: float
    correct: bool
    format_followed: bool
    extracted: str | None
    expected: str
    last_number: str | None
    reason: str

    def metadata(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def feedback(self) -> str:
        if self.correct:
            return f"Correct: {self.expected}."
        return f"Not accepted ({self.reason}); expected {self.expected}."


def verify(
    text: Any,
    expected: Fraction,
    answer_format: str,
    *,
    robust: bool = False,
    wrong_format_reward: float = 0.0,
) -> Verdict:
    """Check a model's final text against `expected`; never raises on any `text`.

    robust=False (arithmetic): the marked span must be exactly one number. robust=True (word
    problems): the last number in the marked span counts, with `$`, units etc. around it.
    `last_number` format is always read robustly. A right value found only as the last number of
    a reply that ignores the format earns `wrong_format_reward` (0 by default: no credit).
    """
    expected_text = format_number(expected)
    if not isinstance(text, str):
        return Verdict(
            0.0,
            False,
            False,
            None,
            expected_text,
            None,
            f"the answer is a {type(text).__name__}, not text",
        )
    fallback = parse_number_robust(text)  # the last number anywhere in the reply
    fallback_text = None if fallback is None else format_number(fallback)
    marked = find_marked(text, answer_format)
    if marked.span is not None:
        lenient = robust or answer_format == "last_number"
        value = parse_number_robust(marked.span) if lenient else parse_number(marked.span)
        if value is not None:
            correct = value == expected
            return Verdict(
                1.0 if correct else 0.0,
                correct,
                True,
                format_number(value),
                expected_text,
                fallback_text,
                "correct" if correct else "wrong value",
            )
        marked = Marked(
            None,
            "no number in the marked answer"
            if lenient
            else f"the {answer_format} answer is not exactly one number",
        )
    if fallback is not None and fallback == expected:
        return Verdict(
            wrong_format_reward,
            False,
            False,
            None,
            expected_text,
            fallback_text,
            f"right value, wrong format: {marked.problem}",
        )
    return Verdict(
        0.0,
        False,
        False,
        None,
        expected_text,
        fallback_text,
        f"format not followed: {marked.problem}",
    )
