import random

import verifiers.v1 as vf


class VfV1ArithData(vf.TaskData):
    """One sum or product; `answer` is its value, as text."""

    answer: str


class VfV1ArithTask(vf.Task[VfV1ArithData]):
    """Correct when the model's last reply is the answer, alone (surrounding space aside)."""

    @vf.reward(weight=1.0)
    async def correct_answer(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class VfV1ArithConfig(vf.TasksetConfig):
    num_tasks: int = 50
    """How many tasks to build."""
    seed: int = 0
    """The seed of the operands."""


class VfV1ArithTaskset(vf.Taskset[VfV1ArithTask, VfV1ArithConfig]):
    def load(self) -> list[VfV1ArithTask]:
        rng = random.Random(self.config.seed)
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            op = "+" if i % 2 == 0 else "*"
            answer = a + b if op == "+" else a * b
            data = VfV1ArithData(
                name=f"{a}{op}{b}",
                system_prompt="Answer with the number only.",
                prompt=f"What is {a} {op} {b}?",
                answer=str(answer),
            )
            tasks.append(VfV1ArithTask(data, self.config.task))
        return tasks
