"""`math.propose`: two roles, one episode. A proposer writes a sum for a target number, a solver
solves it; each is rewarded for its own part, and the proposer only when the solver succeeds.

    proposer  <- "Write two digits that add up to 7."   -> "3 + 4"
    solver    <- "3 + 4 ="                               -> "7"

The roles are plait's ORS extension (`plait_sdk.roles`): the task names
the role that acts first, the proposer's answer hands the turn to the solver, and the solver's
answer ends the episode with both roles' rewards. Rewards: the solver earns 1 for the bare right
number; the proposer earns 1 when its problem is two digits that add up to the target *and* the
solver solved it (so it cannot do well without a solver that does). A proposal that is not of
the form "a + b" ends the episode (the solver has nothing to solve); one that misses the target
is still handed on, so the solver learns from it. A plain ORS client (no roles) plays both parts
with one model: it sees the solver's prompt as the proposer's tool result.

Self-play is a config without `[policies]` (one policy plays both roles); two policies are
`[policies.proposer] roles = ["proposer"]` and `[policies.solver] roles = ["solver"]`
(examples/propose_solve_tiny.toml).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, ClassVar

import attrs

from plait.api import Split, positive
from plait_math.answers import verify
from plait_sdk import Environment, LocalEnvironment, TextBlock, ToolOutput, terminal
from plait_sdk.roles import finish, first_role, hand_over

PROPOSAL = re.compile(r"\s*(\d) \+ (\d)\s*")
MAX_TARGET = 18


@attrs.frozen
class ProposeOptions:
    train_size: int = attrs.field(default=10_000, validator=positive)
    """Tasks cycle through the targets 0..18 (every split has the same 19 targets: what is held
    out is the sampling, not the targets)."""
    test_size: int = attrs.field(default=19, validator=positive)


def proposal_prompt(target: int) -> str:
    return f"Write two digits that add up to {target}."


class ProposeSolve(Environment):
    """A proposer writes "a + b" for the task's target; a solver answers it."""

    options: ClassVar[ProposeOptions]

    @classmethod
    def list_splits(cls) -> Sequence[Split]:
        return [Split("train", "train"), Split("test", "test")]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict[str, Any]]:
        return [cls.task(i) for i in range(cls.size(split))]

    @classmethod
    async def num_tasks(cls, split: str) -> int:
        return cls.size(split)

    @classmethod
    async def get_task(cls, split: str, index: int) -> dict[str, Any]:
        return cls.task(index)

    @classmethod
    def size(cls, split: str) -> int:
        return cls.options.train_size if split == "train" else cls.options.test_size

    @staticmethod
    def task(index: int) -> dict[str, Any]:
        return first_role({"target": index % (MAX_TARGET + 1)}, "proposer")

    def setup(self) -> None:
        target = self.task_spec.get("target")
        if not isinstance(target, int) or not 0 <= target <= MAX_TARGET:
            raise ValueError(
                f"a math.propose task needs an integer target in 0..{MAX_TARGET}, got {target!r}"
            )
        self.target = target
        self.problem: tuple[int, int] | None = None

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(proposal_prompt(self.target))]

    @terminal
    def answer(self, text: str) -> ToolOutput:
        """The proposer's problem, then the solver's answer."""
        if self.problem is None:
            return self.propose(text)
        return self.solve(text)

    def propose(self, text: str) -> ToolOutput:
        match = PROPOSAL.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            return finish(
                'Not a problem: write it as "a + b" with two digits.',
                {"proposer": 0.0},
                metadata={"correct": False},
            )
        self.problem = (int(match[1]), int(match[2]))
        return hand_over("solver", f"{self.problem[0]} + {self.problem[1]} =")

    def solve(self, text: str) -> ToolOutput:
        assert self.problem is not None
        a, b = self.problem
        verdict = verify(text, Fraction(a + b), "plain")
        solved = float(verdict.correct)
        proposed = solved if a + b == self.target else 0.0
        return finish(
            verdict.feedback(),
            {"proposer": proposed, "solver": solved},
            metadata={"correct": proposed == 1.0, "on_target": a + b == self.target},
        )


def make_env(*, options: ProposeOptions) -> LocalEnvironment:
    bound = type(
        "propose", (ProposeSolve,), {"options": options, "__module__": ProposeSolve.__module__}
    )
    return LocalEnvironment(bound, name="math.propose")
