"""Roles in one episode (`plait.rollout.ROLE_KEY`, `REWARDS_KEY`): each role's turns go to the
actor that plays it, with a conversation of its own, and each role's rewards are its own.

The environment, engines and renderer here are minimal implementations of the core protocols (no
torch): the renderer writes each message as "role: text\\n" in bytes, an engine always answers
the same text, so what each role saw and said can be read back from the trajectory.
"""

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from plait.rollout import REWARDS_KEY, ROLE_KEY, EpisodeConfig, run_episode
from plait.types import (
    Message,
    ModelInput,
    ParseTermination,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TextBlock,
    ToolOutput,
    ToolSpec,
)


class BytesRenderer:
    tokenizer = None
    has_extension_property = False

    def build_generation_prompt(
        self, messages: Sequence[Message], role: str = "assistant", **_: Any
    ) -> ModelInput:
        return ModelInput.from_ints(
            list("".join(f"{m.role}: {m.content}\n" for m in messages).encode())
        )

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        return Message("assistant", bytes(tokens).decode()), ParseTermination.EOS

    def bridge_to_next_turn(self, *_: Any) -> None:
        return None

    def stop_sequences(self) -> list[int]:
        return []


class Says:
    """An engine that always answers `text`, at weight version `version`."""

    def __init__(self, text: str, version: int) -> None:
        self.text, self.weight_version, self.prompts = text, version, []

    async def sample(
        self, prompt: ModelInput, num_samples: int, sampling_params: SamplingParams
    ) -> SampleResponse:
        self.prompts.append(bytes(prompt.to_ints()).decode())
        tokens = list(self.text.encode())
        return SampleResponse(
            [
                SampledSequence(
                    tokens, [-0.5] * len(tokens), "stop", weight_version=self.weight_version
                )
            ]
        )


class ProposeSolveSession:
    """The proposer writes a problem (handed to the solver); the solver's answer ends the
    episode."""

    def __init__(self) -> None:
        self.problem: str | None = None

    async def messages(self) -> list[Message]:
        return [Message("user", "Write a sum for 7.")]

    async def tools(self) -> list[ToolSpec]:
        return []

    async def terminal_tool(self) -> ToolSpec:
        return ToolSpec(
            "answer", "", {"type": "object", "properties": {"text": {"type": "string"}}}
        )

    async def call(self, name: str, input: Mapping[str, Any]) -> ToolOutput:
        if self.problem is None:
            self.problem = input["text"]
            return ToolOutput([TextBlock(f"{self.problem} =")], metadata={ROLE_KEY: "solver"})
        solved = float(input["text"] == "7")
        return ToolOutput(
            [TextBlock("done")],
            reward=solved,
            finished=True,
            metadata={REWARDS_KEY: {"proposer": solved * 0.5, "solver": solved}},
        )

    async def close(self) -> None:
        pass


class ProposeSolve:
    async def open(
        self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None
    ) -> ProposeSolveSession:
        return ProposeSolveSession()


TASK = {"target": 7, ROLE_KEY: "proposer"}
CONFIG = EpisodeConfig(SamplingParams(max_tokens=8), max_turns=4)


def test_each_role_plays_with_its_own_actor_and_conversation_and_earns_its_own_reward():
    renderer = BytesRenderer()
    proposer, solver = Says("3 + 4", version=2), Says("7", version=5)
    trajectory = asyncio.run(
        run_episode(
            ProposeSolve(), TASK, proposer, renderer, CONFIG, {"solver": (solver, renderer)}
        )
    )
    assert [turn.role for turn in trajectory.turns] == ["proposer", "solver"]
    assert proposer.prompts == ["user: Write a sum for 7.\n"]
    assert solver.prompts == ["user: 3 + 4 =\n"]  # the solver sees only what it was told
    assert [turn.completion.weight_version for turn in trajectory.turns] == [2, 5]
    assert (
        trajectory.reward == 1.0 and trajectory.finished
    )  # the episode's: what a plain client sees
    assert trajectory.role_rewards == {"proposer": 0.5, "solver": 1.0}
    assert trajectory.acting_roles() == ["proposer", "solver"]

    as_solver = trajectory.for_role("solver")
    assert (
        [turn.role for turn in as_solver.turns] == ["solver"]
        and as_solver.reward == 1.0
        and as_solver.correct
    )
    as_proposer = trajectory.for_role("proposer")
    assert as_proposer.reward == 0.5 and not as_proposer.correct
    (turn,) = as_proposer.turns  # only the proposer's tokens train it
    assert bytes(turn.prompt).decode().startswith("user: Write a sum for 7.\n")


def test_one_actor_plays_every_role_it_is_not_told_otherwise_self_play():
    renderer = BytesRenderer()
    both = Says("7", version=0)
    trajectory = asyncio.run(run_episode(ProposeSolve(), TASK, both, renderer, CONFIG))
    assert [turn.role for turn in trajectory.turns] == ["proposer", "solver"]
    assert both.prompts == ["user: Write a sum for 7.\n", "user: 7 =\n"]
    assert trajectory.role_rewards == {"proposer": 0.5, "solver": 1.0}


def test_an_episode_without_roles_is_what_it_always_was():
    class Plain(ProposeSolveSession):
        async def call(self, name: str, input: Mapping[str, Any]) -> ToolOutput:
            return ToolOutput([TextBlock("ok")], reward=1.0, finished=True)

    class PlainEnv:
        async def open(self, task: Mapping[str, Any], secrets: Any = None) -> Plain:
            return Plain()

    trajectory = asyncio.run(
        run_episode(PlainEnv(), {"q": 1}, Says("7", 0), BytesRenderer(), CONFIG)
    )
    assert trajectory.role_rewards == {} and trajectory.acting_roles() == [""]
    assert trajectory.for_role("") is trajectory and trajectory.reward == 1.0
