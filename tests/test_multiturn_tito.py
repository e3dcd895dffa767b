"""Multi-turn token-in-token-out, end to end: the reference engine (plait-torch), the calculator
environment (plait-math) and the renderers (core, plait-qwen).

The model is tiny-qwen3 with its weights rewritten so that greedy sampling writes one tool call
(`plait_testing.scripted`), tokenized *non-canonically* ("calculator" as "calcul" + "ator"): a
rollout that decoded and re-encoded sampled text would change those ids, so comparing the trained
ids with the engine's catches any re-tokenization. Each episode calls the calculator on every turn
until `max_turns` (4) cuts it off.

- A renderer with the extension property (qwen3_keep_reasoning) bridges every turn: one datum per
  trajectory, which is exactly the last prompt followed by the last completion.
- The official Qwen3 template (qwen3, and the generic chat_template renderer) rewrites the turn,
  so every turn is re-rendered, and each starts a datum of its own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("plait_torch", reason="needs the reference engines (plait-torch)")
pytest.importorskip("plait_math", reason="needs the calculator environment (plait-math)")
pytest.importorskip("plait_qwen", reason="needs the Qwen renderers (plait-qwen)")

from plait.models import ResolvedModel
from plait.plugins import get_registry
from plait.rollout import EpisodeConfig, run_episode
from plait.run.report import rollout_metrics
from plait.trajectory import Trajectory
from plait.types import Datum, SamplingParams
from plait_algorithms.datums import trajectory_to_datums
from plait_hf.chat_template import load_tokenizer
from plait_sdk import Environment, LocalEnvironment, Split, TextBlock, ToolOutput, terminal, tool
from plait_testing.models import materialize_model
from plait_testing.scripted import build_scripted_qwen3, script_tokens

pytestmark = pytest.mark.slow

TOOL_CALL = (
    '<think>\n\n</think>\n\n\n<tool_call>{"name":"calculator","arguments":{"expression":"7*6"}}'
    "</tool_call><|im_end|>"
)
NEWLINE = 198  # the last token of every Qwen generation prompt ("<|im_start|>assistant\n")
TURNS = 4


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize_model(
        "tiny-qwen3", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3"
    ).path


def scripted(
    base: Path, text: str, split: dict[str, list[str]] | None = None
) -> tuple[ResolvedModel, list[int]]:
    tokenizer = load_tokenizer(base)
    script = script_tokens(tokenizer, text, avoid=[NEWLINE], split=split)
    dest = base.parent / f"scripted-{abs(hash(text))}"
    build_scripted_qwen3(base, dest, NEWLINE, script)
    return ResolvedModel("scripted-tiny-qwen3", dest, dest), script


@pytest.fixture(scope="module")
def scripted_model(tiny_qwen3: Path) -> tuple[ResolvedModel, list[int]]:
    model, script = scripted(tiny_qwen3, TOOL_CALL, split={"calculator": ["calcul", "ator"]})
    tokenizer = load_tokenizer(model.tokenizer_path)
    assert tokenizer.encode(tokenizer.decode(script)) != script, "the script must be non-canonical"
    return model, script


def run(
    model: ResolvedModel, renderer_name: str, episodes: int = 2, **limits: Any
) -> list[Trajectory]:
    registry = get_registry()
    engine = registry.get("inference_engine", "torch").load()(model, options=None, seed=0)
    renderer = registry.get("renderer", renderer_name).load()(model, options=None)
    env = registry.get("env", "math.calculator").load()(
        options=registry.get("env", "math.calculator").options_class()()
    )
    config = EpisodeConfig(
        SamplingParams(max_tokens=48, temperature=0.0), **{"max_turns": TURNS, **limits}
    )

    async def episodes_() -> list[Trajectory]:
        tasks = [await env.get_task("train", i) for i in range(episodes)]
        try:
            return list(
                await asyncio.gather(
                    *(run_episode(env, t, engine, renderer, config) for t in tasks)
                )
            )
        finally:
            await engine.close()

    return asyncio.run(asyncio.wait_for(episodes_(), 300))


def action_ids(datums: list[Datum]) -> tuple[list[int], list[float]]:
    """The trained (sampled) target ids and their sampler logprobs, in order."""
    ids: list[int] = []
    logprobs: list[float] = []
    for datum in datums:
        mask = datum.loss_fn_inputs["mask"].to_numpy().astype(bool)
        ids += datum.loss_fn_inputs["target_tokens"].to_numpy()[mask].tolist()
        logprobs += datum.loss_fn_inputs["logprobs"].to_numpy()[mask].tolist()
    return ids, logprobs


def check_episode(trajectory: Trajectory, script: list[int]) -> list[Datum]:
    assert trajectory.error is None and trajectory.tool_errors == 0 and trajectory.parse_errors == 0
    assert trajectory.num_turns == TURNS and trajectory.truncated
    assert all(list(turn.completion.tokens) == script for turn in trajectory.turns)
    datums = trajectory_to_datums(trajectory, advantage=1.0)
    ids, logprobs = action_ids(datums)
    # End to end: every sampled id, and its logprob, reaches the trainer unchanged and in order.
    assert ids == [t for turn in trajectory.turns for t in turn.completion.tokens]
    assert np.allclose(
        logprobs, [lp for turn in trajectory.turns for lp in turn.completion.logprobs]
    )
    return datums


def test_a_renderer_with_the_extension_property_trains_one_datum_per_episode(
    scripted_model: Any,
) -> None:
    model, script = scripted_model
    for trajectory in run(model, "qwen3_keep_reasoning"):
        datums = check_episode(trajectory, script)
        assert len(datums) == 1 and trajectory.bridged_turns == TURNS - 1
        last = trajectory.turns[-1]
        (datum,) = datums
        sequence = [
            *datum.model_input.to_ints(),
            int(datum.loss_fn_inputs["target_tokens"].to_numpy()[-1]),
        ]
        assert sequence == [*last.prompt, *last.completion.tokens]
        for before, after in zip(trajectory.turns, trajectory.turns[1:], strict=False):
            assert list(after.prompt[: len(before.prompt) + len(script)]) == [
                *before.prompt,
                *script,
            ]


@pytest.mark.parametrize("renderer_name", ["qwen3", "chat_template"])
def test_a_template_that_rewrites_history_splits_every_turn(
    scripted_model: Any, renderer_name: str
) -> None:
    model, script = scripted_model
    for trajectory in run(model, renderer_name):
        datums = check_episode(trajectory, script)
        assert len(datums) == TURNS and trajectory.bridged_turns == 0
        for datum, turn in zip(datums, trajectory.turns, strict=True):
            assert datum.model_input.to_ints() == [*turn.prompt, *turn.completion.tokens][:-1]


def test_unparseable_tool_calls_are_answered_with_an_error_and_counted(tiny_qwen3: Path) -> None:
    broken = '<tool_call>{"name":"calculator","arguments":{"expression":}}</tool_call><|im_end|>'
    model, script = scripted(tiny_qwen3, broken)
    for trajectory in run(model, "qwen3_keep_reasoning", episodes=1):
        assert trajectory.num_turns == TURNS and trajectory.truncated
        assert trajectory.parse_errors == TURNS and trajectory.tool_errors == TURNS
        assert not any(turn.parse_ok for turn in trajectory.turns)
        tokenizer = load_tokenizer(model.tokenizer_path)
        assert "could not be parsed" in tokenizer.decode(list(trajectory.turns[1].prompt))
        (datum,) = trajectory_to_datums(trajectory, 1.0)  # the feedback is bridged like any message
        assert action_ids([datum])[0] == script * TURNS


def test_the_context_budget_caps_each_response_and_ends_the_episode(scripted_model: Any) -> None:
    model, script = scripted_model
    (full,) = run(model, "qwen3_keep_reasoning", episodes=1)
    # Room for two whole turns, then 10 tokens of the third response: it is cut off there.
    budget = len(full.turns[2].prompt) + 10
    (capped,) = run(model, "qwen3_keep_reasoning", episodes=1, max_episode_tokens=budget)
    assert [len(t.completion.tokens) for t in capped.turns] == [len(script), len(script), 10]
    assert capped.truncated and capped.turns[-1].completion.stop_reason == "length"
    assert len(capped.turns[-1].prompt) + 10 == budget


class FaultyGrader(Environment):
    """Its grader fails, as a crashed sandbox does: the answer has no reward, not a 0."""

    @classmethod
    def list_splits(cls) -> list[Split]:
        return [Split("train", "train")]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict[str, Any]]:
        return [{"question": "2+2"}]

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock("What is 2+2?")]

    @terminal
    @tool
    def answer(self, text: str) -> ToolOutput:
        raise RuntimeError("the grading sandbox died")


def test_an_answer_whose_grading_fails_costs_its_episode_not_a_zero_reward(
    tiny_qwen3: Path,
) -> None:
    model = ResolvedModel("tiny-qwen3", tiny_qwen3, tiny_qwen3)
    registry = get_registry()
    engine = registry.get("inference_engine", "torch").load()(model, options=None, seed=0)
    renderer = registry.get("renderer", "qwen3").load()(model, options=None)
    env = LocalEnvironment(FaultyGrader)
    config = EpisodeConfig(SamplingParams(max_tokens=8, temperature=0.0, stop=[]))

    async def episode() -> Trajectory:
        try:
            return await run_episode(env, await env.get_task("train", 0), engine, renderer, config)
        finally:
            await engine.close()

    trajectory = asyncio.run(episode())
    assert trajectory.error is not None and "the grading sandbox died" in trajectory.error
    metrics = rollout_metrics([[trajectory]])
    assert (
        metrics["env/errors"] == 1.0 and metrics["reward/mean"] == 0.0
    )  # counted, and no reward recorded
