# ruff: noqa: B006, I001 - kept in the ors documentation's own style (mutable defaults, import order)
"""An environment written for the `ors` package (ors-sdk 0.1.0), in its documented style.

The interop tests run this file unchanged on ors-sdk's server, with its import switched to
`openreward.environments` on openreward's server, and to `plait_sdk` on plait's: porting an ORS
environment to plait is changing that one import line.
"""

from pydantic import BaseModel

from ors import Environment, Split, TextBlock, Toolset, ToolOutput, tool

TASKS = {
    "train": [
        {"id": "t0", "question": "What is 17 + 25?", "answer": "42"},
        {"id": "t1", "question": "What is 9 * 8?", "answer": "72"},
        {"id": "t2", "question": "What is 100 - 37?", "answer": "63"},
        {"id": "t3", "question": "What is 144 / 12?", "answer": "12"},
    ],
    "holdout": [
        {"id": "h0", "question": "What is 6 * 7?", "answer": "42"},
    ],
}


class AnswerParams(BaseModel):
    answer: str


class NoteParams(BaseModel):
    text: str


class Scratchpad(Toolset):
    """Notes the agent can keep during an episode."""

    @tool
    async def note(self, params: NoteParams) -> ToolOutput:
        """Write a note to the scratchpad."""
        self.env.notes.append(params.text)
        return ToolOutput(blocks=[TextBlock(text=f"{len(self.env.notes)} note(s)")], reward=0.0)


class ArithEnv(Environment):
    """Arithmetic word problems: ask for a hint, keep notes, answer once."""

    toolsets = [Scratchpad]

    def __init__(self, task_spec={}, secrets={}):
        super().__init__(task_spec, secrets)
        self.token = secrets.get("TOKEN", "")
        self.notes = []
        self.hints = 0
        self.sandbox = "local"  # openreward's Toolset insists on an env.sandbox; ors ignores it

    def setup(self):
        self.notes = []

    @classmethod
    def list_splits(cls):
        return [Split(name="train", type="train"), "holdout"]

    @classmethod
    def list_tasks(cls, split: str):
        if split not in TASKS:
            raise ValueError(f"Unknown split: {split}")
        return TASKS[split]

    def get_prompt(self):
        return [TextBlock(text=self.task_spec["question"])]

    @tool
    def hint(self) -> ToolOutput:
        """Get a hint (costs a little reward)."""
        self.hints += 1
        digits = len(self.task_spec["answer"])
        return ToolOutput(
            blocks=[TextBlock(text=f"The answer has {digits} digit(s).")],
            reward=-0.1,
            metadata={"hints": self.hints},
        )

    @tool
    def whoami(self) -> ToolOutput:
        """Say whether the session received the TOKEN secret."""
        return ToolOutput(blocks=[TextBlock(text=f"token={self.token}")])

    @tool
    def answer(self, params: AnswerParams) -> ToolOutput:
        """Submit the final answer; ends the episode."""
        correct = params.answer.strip() == self.task_spec["answer"]
        return ToolOutput(
            blocks=[TextBlock(text="Correct!" if correct else "Wrong!")],
            reward=1.0 if correct else 0.0,
            finished=True,
            metadata={"notes": len(self.notes)},
        )
