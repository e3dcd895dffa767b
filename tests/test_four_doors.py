"""One task, four doors: the same reasoning-gym task reached as plait's own environment
(`reasoning_gym`), over ORS (`plait env serve` + `env.name = "ors"`), over OpenEnv (`plait env
serve --protocol openenv` + `env.name = "openenv"`) and through verifiers (its `SingleTurnEnv`
and `Rubric` in their own venv, `env.name = "verifiers"`) gives the same reward for the same
completion.

The completions come from scripted tiny-qwen3 checkpoints (`plait_testing.scripted`), whose
greedy output is a fixed text whatever the prompt, sampled by plait's torch engine through each
door's real path (the verifiers door's through plait-proxy). Each door shows the model its own
prompt (OpenEnv's observation is text, not chat turns), so only a scripted model gives every door
the same completion.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plait.api import EpisodeConfig, ResolvedModel, SamplingParams, build, run_episode
from plait_hf.chat_template import load_tokenizer
from plait_sdk.server import Server
from plait_testing.models import materialize_model
from plait_testing.scripted import build_scripted_qwen3, script_tokens
from plait_testing.venvs import venv_python

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NEWLINE = 198  # the last token of a Qwen generation prompt ("<|im_start|>assistant\n")
TASKS = 8
TASK = {
    "datasets": {
        "basic_arithmetic": {
            "config": {
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 1,
                "max_digits": 1,
                "operators": ["+"],
                "allow_parentheses": False,
                "allow_negation": False,
            }
        }
    },
    "seed": 0,
    "train_size": 50,
    "test_size": TASKS,
    "system_prompt": "direct",
    "few_shot": 2,
}
"""The task every door serves: one- and two-digit sums, reasoning-gym's "direct" prompt."""
COMPLETIONS = {
    "right": "<answer>\n6</answer>",
    "wrong": "<answer>\n7</answer>",
    "untagged": "The sum is 6.",
}
"""Replies every door must score alike: right for the tasks whose sum is 6 (two of the eight),
wrong for all, and one with no answer tag, which reasoning-gym scores 0. (A script's tokens must
be distinct and the vocabulary has one ">" alone, so the first tag ends in ">\n".)"""
TAGS = {"<answer>": ["<", "answer"], "</answer>": ["</", "ans", "wer"]}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ResolvedModel]:
    root = Path(tmp_path_factory.mktemp("models"))
    base = materialize_model("tiny-qwen3", root / "tiny-qwen3").path
    tokenizer = load_tokenizer(base)
    models = {}
    for name, text in COMPLETIONS.items():
        dest = root / f"scripted-{name}"
        build_scripted_qwen3(
            base,
            dest,
            NEWLINE,
            script_tokens(tokenizer, text + "<|im_end|>", avoid=[NEWLINE], split=TAGS),
        )
        models[name] = ResolvedModel(f"scripted-{name}", dest, dest)
    return models


def serve_command(protocol: str) -> list[str]:
    options = [f"{key}={json.dumps(value)}" for key, value in TASK.items() if key != "datasets"]
    return [
        sys.executable,
        "-m",
        "plait.cli",
        "env",
        "serve",
        "reasoning_gym",
        "--protocol",
        protocol,
        "-o",
        "datasets={basic_arithmetic={config={min_terms=2, max_terms=2, min_digits=1, "
        'max_digits=1, operators=["+"], allow_parentheses=false, allow_negation=false}}}',
        *(arg for option in options for arg in ("-o", option)),
        "--port",
        "{port}",
    ]


@pytest.fixture(scope="module")
def doors() -> Iterator[dict[str, Any]]:
    native = build("env", "reasoning_gym", options=TASK)
    server = Server([build("env", "reasoning_gym", options=TASK)])
    with server.serve_in_thread() as url:
        doors = {
            "plait": native,
            "ors": build("env", "ors", options={"url": url, "splits": ["test"]}),
            "openenv": build(
                "env",
                "openenv",
                options={
                    "command": serve_command("openenv"),
                    "splits": {"test": list(range(TASKS))},
                    "split_reset": {"test": {"split": "test"}},
                    "messages_field": "messages",
                },
            ),
            "verifiers": build(
                "env",
                "verifiers",
                options={
                    "environment": "vf-reasoning-gym",
                    "python": venv_python(
                        "PLAIT_VERIFIERS_VENV",
                        REPO / ".venvs" / "verifiers",
                        "scripts/ci/verifiers.sh",
                    ),
                    "args": {
                        "datasets": TASK["datasets"],
                        "seed": TASK["seed"],
                        "num_train_examples": TASK["train_size"],
                        "num_eval_examples": TASK["test_size"],
                        "system_prompt": TASK["system_prompt"],
                        "few_shot": TASK["few_shot"],
                    },
                },
            ),
        }
        yield doors


async def rewards(env: Any, model: ResolvedModel) -> list[tuple[str, float]]:
    """Each test task's greedy episode through `env`: the completion's text and its reward."""
    from plait.api import get_registry

    registry = get_registry()
    engine = registry.get("inference_engine", "torch").load()(model, options=None, seed=0)
    renderer = registry.get("renderer", "qwen3").load()(model, options=None)
    config = EpisodeConfig(SamplingParams(max_tokens=24, temperature=0.0), max_turns=1)
    try:
        results = []
        for index in range(TASKS):
            task = await env.get_task("test", index)
            trajectory = await run_episode(env, task, engine, renderer, config)
            assert trajectory.error is None, trajectory.error
            (turn,) = trajectory.turns
            results.append((renderer.tokenizer.decode(turn.completion.tokens), trajectory.reward))
        return results
    finally:
        await engine.close()


def test_every_door_gives_the_same_reward_for_the_same_completion(
    scripted: dict[str, ResolvedModel], doors: dict[str, Any]
) -> None:
    async def every_door() -> dict[str, dict[str, list[tuple[str, float]]]]:
        try:  # one event loop for all: the doors' servers and drivers belong to it
            return {
                name: {door: await rewards(env, scripted[name]) for door, env in doors.items()}
                for name in COMPLETIONS
            }
        finally:
            for env in doors.values():
                await env.close()

    by_completion = asyncio.run(asyncio.wait_for(every_door(), 900))
    answers = [str(asyncio.run(doors["plait"].get_task("test", i))["answer"]) for i in range(TASKS)]
    assert answers.count("6") == 2, answers
    for name, text in COMPLETIONS.items():
        by_door = by_completion[name]
        for door, results in by_door.items():
            assert [t for t, _ in results] == [text + "<|im_end|>"] * TASKS, (door, results[0])
            assert [r for _, r in results] == [r for _, r in by_door["plait"]], (name, door)
        scores = [r for _, r in by_door["plait"]]
        if name == "right":
            assert [a for a, r in zip(answers, scores, strict=True) if r == 1.0] == ["6", "6"]
        else:
            assert scores == [0.0] * TASKS
