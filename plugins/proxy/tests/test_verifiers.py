"""The `verifiers` environment: verifiers 0.1.14 environments, unmodified, in the venv
scripts/ci/verifiers.sh builds, their rollouts and rubrics run by the driver with the model
calls through the proxy in front of plait-torch.

The model is tiny-qwen3 rewritten to write one fixed completion whatever it is shown
(`plait_testing.scripted`), built per test once the task (and so its answer) is known: for
examples/verifiers/vf_arith (SingleTurnEnv, answer 1.0 + format 0.2) the right answer in
<answer> tags, for vf_calculator (ToolEnv) the answer beside a `calculator` call, so that the
rollout calls the tool until the run's max_turns cuts it off and is scored on its last message.
Checked: the trajectory's ids are the script's as sampled, the reward and `env/reward/<name>` are
the rubric's (for vf_arith, the rubric scoring the same completion in a process of its own), and
the failures: an environment that raises or scores NaN costs its episode, the engine failing
raises, a missing venv or package stops with the fix.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from plait.api import (
    ConfigError,
    EngineError,
    EpisodeConfig,
    ResolvedModel,
    SamplingParams,
    get_registry,
)
from plait_proxy.verifiers import VerifiersEnvironment, VerifiersOptions
from plait_testing.venvs import venv_python

pytestmark = pytest.mark.slow
pytest.importorskip("plait_qwen", reason="needs the Qwen renderers (plait-qwen)")

REPO = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
TIMEOUT_S = 240  # the driver's imports alone take 8 s here; the machine may be busy

BROKEN_ENV = """
import verifiers as vf
from datasets import Dataset


class Broken(vf.SingleTurnEnv):
    async def setup_state(self, state):
        if state["answer"] == "raise":
            raise RuntimeError("the environment broke")


def nan_reward(answer) -> float:
    return float("nan") if answer == "nan" else 1.0


def load_environment():
    rows = [{"question": "q", "answer": "raise"}, {"question": "q", "answer": "nan"}]
    return Broken(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[nan_reward]))
"""

SCORE = """
import asyncio, json, sys
import verifiers as vf
from openai import AsyncOpenAI
from verifiers.utils.message_utils import normalize_messages

request = json.loads(sys.argv[1])
env = vf.load_environment(request["environment"])
row = env.get_eval_dataset()[request["index"]]
client = vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url="http://127.0.0.1:9", api_key="-"))

async def score():
    state = await env.init_state(row, client, "plait")
    state["completion"] = normalize_messages(request["completion"], field_name="completion")
    state["trajectory"] = [{}]  # its one model call (the monitor rubric counts them)
    await env.rubric.score_rollout(state)
    return {"reward": state["reward"], "metrics": state["metrics"]}

print(json.dumps(asyncio.run(score())))
"""


@pytest.fixture(scope="session")
def verifiers_python() -> str:
    return venv_python(
        "PLAIT_VERIFIERS_VENV", REPO / ".venvs" / "verifiers", "scripts/ci/verifiers.sh"
    )


def scripted(base: ResolvedModel, name: str, text: str) -> tuple[ResolvedModel, list[int]]:
    """tiny-qwen3 whose greedy completion of any prompt is `text`, and its ids."""
    from plait_testing.scripted import scripted_qwen3

    model, ids = scripted_qwen3(base.path, base.path.parent / f"verifiers-{name}", text)
    return model, ids


async def task_with_distinct_digits(env: VerifiersEnvironment, split: str) -> dict[str, Any]:
    """The first task whose answer repeats no digit: a script's tokens must be distinct, and the
    tokenizer writes digits one by one."""
    for index in range(await env.num_tasks(split)):
        task = await env.get_task(split, index)
        digits = [c for c in task["answer"] if c.isdigit()]
        if len(set(digits)) == len(digits):
            return task
    raise AssertionError(f"no task of {env.name} has an answer without repeated digits")


def actors(model: ResolvedModel) -> tuple[Any, Any]:
    registry = get_registry()
    engine = registry.get("inference_engine", "torch").load()(model, options=None, seed=0)
    renderer = registry.get("renderer", "qwen3_keep_reasoning").load()(model, options=None)
    return engine, renderer


def test_a_single_turn_environment_trains_on_what_the_engine_sampled_and_its_rubric_scores(
    verifiers_python: str, tiny_qwen3: ResolvedModel
) -> None:
    env = VerifiersEnvironment(VerifiersOptions(environment="vf-arith", python=verifiers_python))

    async def go() -> tuple[Any, ...]:
        try:
            splits = await env.splits()
            sizes = {s.name: await env.num_tasks(s.name) for s in splits}
            task = await task_with_distinct_digits(env, "test")
            model, ids = scripted(  # "\n" after the tag: a lone ">" may come once only
                tiny_qwen3,
                "arith",
                f"<think>compute</think>\n\n<answer>{task['answer']}</answer>\n<|im_end|>",
            )
            engine, renderer = actors(model)
            try:
                trajectory = await env.run_episode(task, engine, renderer, EpisodeConfig(GREEDY))
            finally:
                await engine.close()
            return splits, sizes, task, trajectory, ids
        finally:
            await env.close()

    splits, sizes, task, trajectory, ids = asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
    assert [(s.name, s.type) for s in splits] == [("train", "train"), ("test", "test")]
    assert sizes == {"train": 200, "test": 50}
    assert task["prompt"][-1]["role"] == "user" and task["prompt"][-1]["content"].startswith(
        "What is"
    )
    assert trajectory.error is None
    assert len(trajectory.turns) == 1 and list(trajectory.turns[0].completion.tokens) == ids
    assert trajectory.finished and not trajectory.truncated and trajectory.correct
    # the rubric's own scoring of the same completion, in a process of its own
    completion = [{"role": "assistant", "content": f"<answer>{task['answer']}</answer>"}]
    request = {"environment": "vf-arith", "index": task["index"], "completion": completion}
    scored = json.loads(
        subprocess.run(
            [verifiers_python, "-c", SCORE, json.dumps(request)],
            capture_output=True,
            text=True,
            check=True,
            timeout=TIMEOUT_S,
        ).stdout.splitlines()[-1]
    )
    assert trajectory.metrics == {f"env/reward/{k}": v for k, v in scored["metrics"].items()}
    assert trajectory.metrics == {
        "env/reward/correct_answer": 1.0,
        "env/reward/format_reward_func": 1.0,
        "env/reward/num_turns": 1.0,  # the monitor every multi-turn rubric gets, weighing 0
    }
    assert trajectory.reward == pytest.approx(scored["reward"]) == pytest.approx(1.0 + 0.2)
    assert trajectory.rewards == (trajectory.reward,)


def test_a_tool_environment_runs_its_tools_over_several_turns_until_max_turns(
    verifiers_python: str, tiny_qwen3: ResolvedModel
) -> None:
    env = VerifiersEnvironment(
        VerifiersOptions(environment="vf-calculator", python=verifiers_python)
    )

    async def go() -> tuple[Any, ...]:
        try:
            task = await task_with_distinct_digits(env, "train")
            unused = [d for d in "0123456789" if d not in task["answer"]]
            expression = f"{unused[0]}*{unused[1]}"  # what it computes does not matter here
            call = json.dumps(
                {"name": "calculator", "arguments": {"expression": expression}},
                separators=(",", ":"),
            )
            model, ids = scripted(
                tiny_qwen3,
                "calculator",
                f"<think>use the tool</think>\n\n{task['answer']}\n\n\n"
                f"<tool_call>{call}</tool_call><|im_end|>",
            )
            engine, renderer = actors(model)
            try:
                config = EpisodeConfig(GREEDY, max_turns=2)
                trajectory = await env.run_episode(task, engine, renderer, config)
            finally:
                await engine.close()
            return task, trajectory, ids
        finally:
            await env.close()

    _, trajectory, ids = asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
    assert trajectory.error is None
    assert [list(turn.completion.tokens) for turn in trajectory.turns] == [ids, ids]
    # the second prompt extends the first call's tokens (the tool's answer bridged on)
    first, second = trajectory.turns
    prefix = [*first.prompt, *ids]
    assert list(second.prompt[: len(prefix)]) == prefix and second.prompt_source == "bridge"
    assert trajectory.truncated and not trajectory.finished  # the third call was refused
    assert trajectory.metrics == {
        "env/reward/correct_answer": 1.0,
        "env/reward/num_turns": 2.0,
        "env/reward/total_tool_calls": 2.0,
        "env/reward/calculator_calls": 2.0,
    }
    assert trajectory.reward == 1.0 and trajectory.correct  # the monitors weigh 0


def test_failures_cost_the_episode_or_stop_the_run_with_the_fix(
    verifiers_python: str,
    tiny_qwen3: ResolvedModel,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "broken_env.py").write_text(BROKEN_ENV)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    broken = VerifiersEnvironment(
        VerifiersOptions(environment="broken_env", python=verifiers_python)
    )
    missing = VerifiersEnvironment(
        VerifiersOptions(environment="vf-not-installed", python=verifiers_python)
    )
    no_venv = VerifiersEnvironment(
        VerifiersOptions(environment="vf-arith", python=str(tmp_path / "none" / "bin" / "python"))
    )

    class FailingEngine:
        weight_version = 0

        async def sample(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("the GPU fell over")

    async def go() -> dict[str, Any]:
        engine, renderer = actors(tiny_qwen3)
        config = EpisodeConfig(SamplingParams(temperature=1.0, max_tokens=4))
        seen: dict[str, Any] = {}
        try:
            raising, nan = [await broken.get_task("train", i) for i in (0, 1)]
            seen["raising"] = await broken.run_episode(raising, engine, renderer, config)
            seen["nan"] = await broken.run_episode(nan, engine, renderer, config)
            with pytest.raises(EngineError, match="the GPU fell over"):
                await broken.run_episode(nan, FailingEngine(), renderer, config)  # type: ignore[arg-type]
            assert not broken.proxy.store.sessions  # every session discarded
            for env, where in ((missing, "environment"), (no_venv, "python")):
                with pytest.raises(ConfigError, match=f"env.options.{where}") as caught:
                    await env.splits()
                assert "scripts/ci/verifiers.sh" in str(caught.value)
                seen[where] = str(caught.value)
        finally:
            await engine.close()
            for env in (broken, missing, no_venv):
                await env.close()
        return seen

    seen = asyncio.run(asyncio.wait_for(go(), TIMEOUT_S))
    assert seen["raising"].error == (
        "verifiers(broken_env): RuntimeError: the environment broke"
    ), seen["raising"].error
    assert "not a number" in seen["nan"].error and seen["nan"].error.startswith(
        "verifiers(broken_env)"
    )
    assert "Could not import 'vf-not-installed'" in seen["environment"]


RG_CONFIG = REPO / "examples" / "reasoning_gym_smollm2.toml"
EVAL_TASKS = 16


def test_plait_eval_agrees_with_vf_eval_at_temperature_zero(
    verifiers_python: str, tmp_path: Path
) -> None:
    """examples/reasoning_gym_smollm2.toml's model (SmolLM2-135M-Instruct) on vf-reasoning-gym,
    its held-out tasks greedy: `plait eval` through the `verifiers` environment, and verifiers'
    own `vf-eval` against `plait serve proxy` serving the same config, give the same reward per
    task and the same pass@1 (verifiers' rule: reward >= its pass_threshold)."""
    env = tomllib.loads(RG_CONFIG.read_text())["env"]["options"]
    args = {
        "datasets": env["datasets"],
        "seed": env["seed"],
        "num_train_examples": env["train_size"],
        "num_eval_examples": env["test_size"],
        "system_prompt": env["system_prompt"],
        "few_shot": env["few_shot"],
    }
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve = [sys.executable, "-m", "plait.cli", "serve", "proxy", str(RG_CONFIG)]
    server = subprocess.Popen([*serve, "--port", str(port)], cwd=REPO)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not _answers(f"http://127.0.0.1:{port}/v1/models"):
            assert server.poll() is None and time.monotonic() < deadline, "plait serve proxy died"
            time.sleep(1)
        subprocess.run(
            [
                str(Path(verifiers_python).with_name("vf-eval")),
                "vf-reasoning-gym",
                *("-a", json.dumps(args), "-b", f"http://127.0.0.1:{port}/v1"),
                *("-k", "OPENAI_API_KEY", "-m", "smollm2-135m-instruct"),
                *("-n", str(EVAL_TASKS), "-r", "1", "-T", "0", "-t", "16"),
                *("--disable-tui", "-s", "-o", str(tmp_path / "vf")),
            ],
            env={**os.environ, "OPENAI_API_KEY": "none"},
            check=True,
            capture_output=True,
            timeout=TIMEOUT_S,
        )
    finally:
        server.terminate()
        server.wait(30)
    (run,) = (tmp_path / "vf" / "evals").glob("*/*")
    vf_meta = json.loads((run / "metadata.json").read_text())
    vf_rows = [json.loads(line) for line in (run / "results.jsonl").open()]
    vf_rewards = [r["reward"] for r in sorted(vf_rows, key=lambda r: r["example_id"])]
    # verifiers' pass@1: a rollout passes at reward >= the environment's pass_threshold
    vf_pass = sum(r >= vf_meta["pass_threshold"] for r in vf_rewards) / len(vf_rewards)

    plait_eval = [
        sys.executable, "-m", "plait.cli", "eval", str(RG_CONFIG), "--env", "verifiers",
        "--env-option", 'environment="vf-reasoning-gym"',
        "--env-option", f"python={json.dumps(verifiers_python)}",
        "--env-option", f"args={_toml(args)}",
        "--tasks", str(EVAL_TASKS), "--output", str(tmp_path / "plait.jsonl"),
    ]  # fmt: skip
    summary = subprocess.run(
        plait_eval, cwd=REPO, check=True, capture_output=True, text=True, timeout=TIMEOUT_S
    ).stdout
    rows = [json.loads(line) for line in (tmp_path / "plait.jsonl").open()]
    plait_rewards = [r["rewards"][0] for r in sorted(rows, key=lambda r: r["index"])]
    plait_pass = sum(r["correct"][0] for r in rows) / len(rows)

    assert plait_rewards == vf_rewards, (plait_rewards, vf_rewards)
    assert 0 < plait_pass < 1 and plait_pass == pytest.approx(vf_pass)
    assert f"pass@1 {plait_pass:.4f}" in summary, summary


def _toml(value: Any) -> str:
    """`value` as a TOML inline value (what `--env-option KEY=VALUE` takes)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)  # strings, numbers and booleans are written alike


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False
