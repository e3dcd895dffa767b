"""A safe calculator: numbers, + - * / ** (or ^), parentheses; exact rational arithmetic.

The input is untrusted model output. It is never `eval`ed: it is parsed with `ast` after a
character allow-list, only number literals, the four operations, powers and signs are accepted,
and limits on length, syntax-tree depth, literal length, exponent and the size of every
intermediate result (in bits) keep any input fast and small: nothing can hang, exhaust memory or
raise anything but `CalculatorError`, whose message says what to change.
"""

from __future__ import annotations

import ast
import decimal
import re
from fractions import Fraction

MAX_EXPRESSION_CHARS = 300
MAX_DEPTH = 100  # bounds the evaluator's recursion; 300 characters allow ~150 levels
MAX_LITERAL_CHARS = 40
MAX_RESULT_BITS = 2048  # about 616 decimal digits, for every intermediate numerator/denominator
MAX_EXPONENT = 1024

_ALLOWED = re.compile(r"[0-9.+\-*/()\s]*")
_REWRITES = {"^": "**", "×": "*", "÷": "/", "−": "-"}  # ^ and the typographic signs models write


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be computed; the message says why."""


def evaluate(expression: object) -> Fraction:
    """The exact value of `expression`, or CalculatorError."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(
            f"the expression has {len(expression)} characters; the limit is "
            f"{MAX_EXPRESSION_CHARS}: split it into steps"
        )
    text = expression.strip().removesuffix("=").strip()
    for old, new in _REWRITES.items():
        text = text.replace(old, new)
    if not text:
        raise CalculatorError("the expression is empty; write e.g. 12 * (3 + 4)")
    if not _ALLOWED.fullmatch(text):
        bad = sorted({c for c in text if not _ALLOWED.fullmatch(c)})
        raise CalculatorError(
            f"characters {''.join(bad)!r} are not allowed; use digits, a decimal point, "
            "+ - * / ** ^ and parentheses (no names, no thousands separators)"
        )
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"cannot parse the expression: {getattr(exc, 'msg', exc)}") from None
    _check_shape(tree)
    return _eval(tree.body, text)


def _check_shape(tree: ast.AST) -> None:
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CalculatorError(
                f"the expression nests deeper than {MAX_DEPTH} levels; split it into steps"
            )
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _eval(node: ast.AST, source: str) -> Fraction:
    if isinstance(node, ast.Constant):
        literal = ast.get_source_segment(source, node) or ""
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"{literal!r} is not a number")
        if len(literal) > MAX_LITERAL_CHARS:
            raise CalculatorError(
                f"a number has {len(literal)} characters; the limit is {MAX_LITERAL_CHARS}"
            )
        try:
            return Fraction(literal)
        except ValueError:
            raise CalculatorError(f"{literal!r} is not a number") from None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand, source)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, source), _eval(node.right, source)
        return _bounded(_apply(node.op, left, right))
    raise CalculatorError(
        f"{ast.get_source_segment(source, node)!r} is not arithmetic this calculator does"
    )


def _bits(value: Fraction) -> int:
    return max(value.numerator.bit_length(), value.denominator.bit_length())


def _bounded(value: Fraction) -> Fraction:
    if _bits(value) > MAX_RESULT_BITS:
        raise CalculatorError(
            f"a result has more than {MAX_RESULT_BITS} bits (about 600 digits); use smaller numbers"
        )
    return value


def _apply(op: ast.operator, left: Fraction, right: Fraction) -> Fraction:
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        return left * right
    if isinstance(op, ast.Div):
        if right == 0:
            raise CalculatorError("division by zero")
        return left / right
    if isinstance(op, ast.Pow):
        if right.denominator != 1:
            raise CalculatorError("only whole-number exponents are supported")
        exponent = right.numerator
        if abs(exponent) > MAX_EXPONENT:
            raise CalculatorError(f"the exponent {exponent} is beyond the limit of {MAX_EXPONENT}")
        if left == 0 and exponent < 0:
            raise CalculatorError("division by zero (0 to a negative power)")
        if _bits(left) * abs(exponent) > MAX_RESULT_BITS and abs(left) != 1:
            raise CalculatorError(
                f"the power is too large (more than {MAX_RESULT_BITS} bits); use smaller numbers"
            )
        return left**exponent
    raise CalculatorError(f"the operator {type(op).__name__} is not supported; use + - * / ** only")


def format_result(value: Fraction) -> str:
    """`1234`, or `2.33333333333 (exactly 7/3)` for a non-integer."""
    if value.denominator == 1:
        return str(value.numerator)
    with decimal.localcontext() as ctx:
        ctx.prec = 12
        approx = decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)
    return f"{approx.normalize():f} (exactly {value.numerator}/{value.denominator})"
