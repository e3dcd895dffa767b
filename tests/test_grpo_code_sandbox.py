"""End to end: GRPO with the reference engines (plait-torch) on a code task whose answers are
graded by hidden tests in Docker sandboxes (plait-docker), through `plait run` and the example
config. Learning is not expected at this scale; the rewards must be right."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from plait.plugins import build

pytest.importorskip("plait_docker", reason="needs the Docker sandboxes (plait-docker)")
pytest.importorskip("plait_torch", reason="needs the reference engines (plait-torch)")
from plait_docker.engine import LABEL_OWNER_PID, LABEL_SANDBOX, connect

pytestmark = [pytest.mark.docker, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "code_python_smollm2.toml"
SMALL_RUN = [
    "rl.steps=1",
    "rl.groups_per_batch=2",
    "rl.group_size=4",
    "rl.max_tokens=96",
    "eval.every=0",
    "eval.tasks=1",
    "eval.samples_per_task=1",
]


async def regrade(samples: list[dict]) -> list[float]:
    """Grade the recorded completions again, through a separate sandbox."""
    env = build("env", "code.python", options={"sandbox": {"pool_size": 1, "timeout_s": 5}})
    rewards = []
    try:
        for sample in samples:
            session = await env.open(sample["task"])
            answer = sample["completion"][-1].removesuffix(
                "<|im_end|>"
            )  # the renderer strips the end token
            output = await session.call("submit", {"answer": answer})
            await session.close()
            rewards.append(output.reward)
    finally:
        await env.close()
    return rewards


def test_grpo_on_code_python_end_to_end(tmp_path):
    overrides = [arg for item in [*SMALL_RUN, f"run.out_dir={tmp_path}"] for arg in ("-s", item)]
    with subprocess.Popen(
        [sys.executable, "-m", "plait.cli", "run", str(EXAMPLE), *overrides, "--no-resume"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as run:
        _, stderr = run.communicate(timeout=2400)
    assert run.returncode == 0, stderr[-3000:]
    run_dir = tmp_path / "code-python-smollm2"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(m for m in metrics if m.get("step") == 1 and "reward/mean" in m)
    assert 0.0 <= step["reward/mean"] <= 1.0
    assert step["time/verify"] > 0  # the sandbox graded the samples

    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["error"] is None for s in samples)
    recorded = [s["reward"] for s in samples]
    assert asyncio.run(regrade(samples)) == pytest.approx(recorded)

    # the run closed its environment: none of its sandbox containers is left
    containers = connect().containers.list(all=True, filters={"label": f"{LABEL_SANDBOX}=1"})
    assert [c.name for c in containers if c.labels[LABEL_OWNER_PID].startswith(f"{run.pid}:")] == []
