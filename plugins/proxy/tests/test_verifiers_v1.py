"""The `verifiers` environment with `api = "v1"`: a verifiers 0.4.0 (`verifiers.v1`) taskset,
unmodified, in the venv scripts/ci/verifiers_v1.sh builds; its episodes run by the v1 driver (the
`null` harness in a subprocess, its streaming chat requests forwarded by verifiers' interception
proxy to the proxy in front of plait-torch) and scored by the task's `@vf.reward`s.

The model is tiny-qwen3 rewritten to write one fixed completion whatever it is shown
(`plait_testing.scripted`): the answer of one task of examples/verifiers/vf_v1_arith. Two episodes
run at once, that task's (right) and another's (wrong). Checked: each trajectory's ids are the
script's as sampled, and its reward and `env/reward/<name>` are the task's own scoring of the same
reply (its reward and metric functions, in a process of their own); a missing venv stops with the
fix.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from plait.api import ConfigError, EpisodeConfig, ResolvedModel, SamplingParams, get_registry
from plait_proxy.verifiers import VerifiersEnvironment, VerifiersOptions, default_python
from plait_testing.venvs import venv_python

pytestmark = pytest.mark.slow
pytest.importorskip("plait_qwen", reason="needs the Qwen renderers (plait-qwen)")

REPO = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
TIMEOUT_S = 240  # the first rollout has uv install the chat program's dependencies
ARGS = {"num_tasks": 8}

SCORE = """
import asyncio, json, sys
from types import SimpleNamespace
from verifiers.v1.utils.decorators import invoke
from verifiers.v1.utils.loaders import load_environment, resolve_env_config

request = json.loads(sys.argv[1])
env = load_environment(resolve_env_config({"taskset": {"id": "vf-v1-arith", **request["args"]}}))
tasks = list(env.taskset)

async def score(index, reply):
    task = tasks[index]
    available = {"task": task.data, "trace": SimpleNamespace(last_reply=reply.strip())}
    rewards = {
        fn.__name__: (await invoke(fn, available), fn._vf_weight) for fn in task.hooks("reward")
    }
    metrics = {fn.__name__: await invoke(fn, available) for fn in task.hooks("metric")}
    return {
        "reward": sum(score * weight for score, weight in rewards.values()),
        "metrics": {**{name: score for name, (score, _) in rewards.items()}, **metrics},
    }

async def main():
    return [await score(index, request["reply"]) for index in request["indices"]]

print(json.dumps(asyncio.run(main())))
"""


@pytest.fixture(scope="session")
def verifiers_v1_python() -> str:
    return venv_python(
        "PLAIT_VERIFIERS_V1_VENV", REPO / ".venvs" / "verifiers-v1", "scripts/ci/verifiers_v1.sh"
    )


def scripted(base: ResolvedModel, name: str, text: str) -> tuple[ResolvedModel, list[int]]:
    """tiny-qwen3 whose greedy completion of any prompt is `text`, and its ids."""
    from plait_testing.scripted import scripted_qwen3

    model, ids = scripted_qwen3(base.path, base.path.parent / f"verifiers-v1-{name}", text)
    return model, ids


def test_a_v1_taskset_trains_on_what_the_engine_sampled_and_its_task_scores(
    verifiers_v1_python: str, tiny_qwen3: ResolvedModel
) -> None:
    env = VerifiersEnvironment(
        VerifiersOptions(environment="vf-v1-arith", api="v1", args=ARGS, python=verifiers_v1_python)
    )

    async def go() -> tuple[Any, ...]:
        try:
            splits = await env.splits()
            sizes = {s.name: await env.num_tasks(s.name) for s in splits}
            tasks = [await env.get_task("train", i) for i in range(sizes["train"])]
            # a script's tokens must be distinct, and the tokenizer writes digits one by one
            right = next(t for t in tasks if len(set(t["answer"])) == len(t["answer"]))
            wrong = next(t for t in tasks if t["answer"] != right["answer"])
            model, ids = scripted(tiny_qwen3, "arith", f"{right['answer']}<|im_end|>")
            registry = get_registry()
            engine = registry.get("inference_engine", "torch").load()(model, options=None, seed=0)
            renderer = registry.get("renderer", "qwen3_keep_reasoning").load()(model, options=None)
            try:
                trajectories = await asyncio.gather(
                    *(
                        env.run_episode(task, engine, renderer, EpisodeConfig(GREEDY))
                        for task in (right, wrong)
                    )
                )
            finally:
                await engine.close()
            return splits, sizes, right, wrong, trajectories, ids
        finally:
            await env.close()

    splits, sizes, right, wrong, trajectories, ids = asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
    assert [(s.name, s.type) for s in splits] == [("train", "train"), ("test", "test")]
    assert sizes == {"train": 8, "test": 8}  # the taskset's one list of tasks
    assert right["prompt"].startswith("What is") and right["system_prompt"]
    # the task's own reward and metric functions on the same reply, in a process of their own
    request = {"args": ARGS, "indices": [right["index"], wrong["index"]], "reply": right["answer"]}
    scored = json.loads(
        subprocess.run(
            [verifiers_v1_python, "-c", SCORE, json.dumps(request)],
            capture_output=True,
            text=True,
            check=True,
            timeout=TIMEOUT_S,
        ).stdout.splitlines()[-1]
    )
    for trajectory, own in zip(trajectories, scored, strict=True):
        assert trajectory.error is None
        assert len(trajectory.turns) == 1 and list(trajectory.turns[0].completion.tokens) == ids
        assert trajectory.finished and not trajectory.truncated
        assert trajectory.metrics == {f"env/reward/{k}": v for k, v in own["metrics"].items()}
        assert trajectory.reward == pytest.approx(own["reward"])
        assert trajectory.rewards == (trajectory.reward,)
    good, bad = trajectories
    assert good.metrics == {
        "env/reward/correct_answer": 1.0,
        "env/reward/reply_chars": float(len(right["answer"])),  # a metric: it weighs 0
    }
    assert good.reward == 1.0 and good.correct
    assert bad.reward == 0.0 and not bad.correct


def test_a_missing_v1_venv_stops_with_the_fix(tmp_path: Path) -> None:
    options = VerifiersOptions(
        environment="vf-v1-arith", api="v1", python=str(tmp_path / "none" / "bin" / "python")
    )
    env = VerifiersEnvironment(options)
    with pytest.raises(ConfigError, match=r"verifiers_v1\.sh"):
        asyncio.run(env.splits())
    # each api's default interpreter is its own venv's
    assert VerifiersOptions(environment="x", api="v1").python == default_python("v1")
    assert VerifiersOptions(environment="x").python == default_python("0.1") != default_python("v1")
