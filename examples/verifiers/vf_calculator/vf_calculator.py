"""Three-operand arithmetic as a verifiers ToolEnv: the model may call `calculator` (Python,
in-process) as often as it likes and answers with the number; the rubric checks the answer of
its last message. The data is generated here (seeded)."""

import ast
import operator
import random

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Use the calculator tool to compute the result, then reply with only the number."

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: The expression, e.g. "12 * (3 + 4)".

    Returns:
        The value of the expression.
    """

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    return str(value(ast.parse(expression, mode="eval").body))


def make_rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        rows.append({"question": f"What is {a} * {c} + {b}?", "answer": str(a * c + b)})
    return rows


def load_environment(
    num_train: int = 200, num_eval: int = 50, seed: int = 0, max_turns: int = 4
) -> vf.Environment:
    parser = vf.Parser()

    def correct_answer(parser, completion, answer) -> float:
        response = parser.parse_answer(completion) or ""
        return 1.0 if response.strip() == answer else 0.0

    rubric = vf.Rubric(funcs=[correct_answer], parser=parser)
    return vf.ToolEnv(
        dataset=Dataset.from_list(make_rows(num_train, seed)),
        eval_dataset=Dataset.from_list(make_rows(num_eval, seed + 1)),
        system_prompt=SYSTEM_PROMPT,
        parser=parser,
        rubric=rubric,
        tools=[calculator],
        max_turns=max_turns,
    )
