"""Two-operand arithmetic as a verifiers SingleTurnEnv: the answer goes in <answer> tags; the
rubric weighs a correct answer 1.0 and the format 0.2. The data is generated here (seeded), so
the environment needs no dataset download."""

import random

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Compute the result. Give only the number inside <answer>...</answer>."


def make_rows(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["+", "-", "*"])
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(result)})
    return rows


def load_environment(num_train: int = 200, num_eval: int = 50, seed: int = 0) -> vf.Environment:
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct_answer(parser, completion, answer) -> float:
        response = parser.parse_answer(completion) or ""
        return 1.0 if response.strip() == answer else 0.0

    rubric = vf.Rubric(
        funcs=[correct_answer, parser.get_format_reward_func()],
        weights=[1.0, 0.2],
        parser=parser,
    )
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(make_rows(num_train, seed)),
        eval_dataset=Dataset.from_list(make_rows(num_eval, seed + 1)),
        system_prompt=SYSTEM_PROMPT,
        parser=parser,
        rubric=rubric,
    )
