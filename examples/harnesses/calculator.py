"""The calculator tool the example harnesses give their models, shared by the programs here.

`calculator` is a plain function with a Google-style docstring and type hints, which is what
openai-agents' `function_tool` and smolagents' `tool` read a tool's schema from; the plain-SDK
programs send `NAME`, `DESCRIPTION` and `PARAMETERS` in their APIs' own tool shapes. The programs
run as scripts, so this folder is on their `sys.path` and `import calculator` finds this file.
"""

import ast
import operator

NAME = "calculator"
DESCRIPTION = "Evaluate an arithmetic expression such as 17 * (3 + 4)."
PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string"}},
    "required": ["expression"],
}
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 17 * (3 + 4).

    Args:
        expression: The arithmetic expression (numbers and + - * / // % ** and parentheses).
    """
    try:
        return str(_value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ArithmeticError) as e:
        return f"error: {e}"


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"unsupported: {ast.unparse(node)}")
