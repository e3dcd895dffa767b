"""Lossless resume: a run SIGKILLed at many different moments, restarted each time, trains every
prompt's every sample exactly once, in the run's task order.

Each attempt is a real `plait run` process (a random tiny Qwen3-MoE, tiny-qwen3-moe's shape on
tiny-qwen3-8k's vocabulary, with routing replay on: the sampler records every token's experts and
the trainer forces them; math.arith, plait-torch engines) that kills itself with SIGKILL at a
fault-injection point (`PLAIT_CRASH_AT=<point>:<step>`, see `plait.run.checkpoint.crash_point`):
while sampling, after an optimizer step, during the in-flight weight update, halfway through writing
a checkpoint, and just after one. The run directory's trained.jsonl (what the checkpointed weights
have seen) is the evidence: after the final, uninterrupted attempt it must hold steps 1..N once
each, and the samples of positions 0..N*groups_per_batch-1 once each. In the async schedule, the
samples a checkpoint held (completed, not yet trained) are trained as sampled, after a resume too,
which the ledger's attempt numbers show (how many a checkpoint holds depends on timing), routing
included: the ledger's digest covers each sample's routed experts, and a held sample's digest,
recomputed from the checkpoint, is the one that was trained. The sync run is PPO with a critic
(a value head on a copy of the model, `[critic]`): every checkpoint holds the critic's state, and
the critic, resumed with the policy, has taken one training step per step of the run. (Not the
async run: a slower training step lets its sampling run further ahead, so whether a crash point
in sampling is reached after a resume would depend on timing.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("plait_torch", reason="needs the reference engines (plait-torch)")
pytest.importorskip("plait_math", reason="needs the arithmetic environment (plait-math)")

from plait.plugins import build
from plait.run.checkpoint import CRASH_ENV, LEDGER_FILE
from plait.run.state import TaskSampler, TrainedSample
from plait.serde import from_json
from plait.trajectory import Trajectory

pytestmark = pytest.mark.slow

STEPS, GROUPS, GROUP_SIZE = 8, 2, 2


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random MoE with the cut tokenizer: each attempt loads it and each checkpoint saves it
    with its optimizer state, 13 MB instead of 240 with Qwen3's full vocabulary."""
    from plait_torch.models import TINY_QWEN3_8K_CONFIG, TINY_QWEN3_MOE_CONFIG, build_random_qwen3

    dest = tmp_path_factory.mktemp("models") / "tiny-qwen3-moe-8k"
    vocabulary = TINY_QWEN3_8K_CONFIG["vocab_size"]
    build_random_qwen3(
        dest, "Qwen3Moe", {**TINY_QWEN3_MOE_CONFIG, "vocab_size": vocabulary}, vocabulary
    )
    return dest


CRITIC = """
[critic.trainer]
options = { value_head = true }
"""
PPO = 'advantage = "gae"\nremove_constant_reward_groups = false'


def write_config(path: Path, model: Path, out_dir: Path, schedule: str) -> Path:
    with_critic = schedule == "sync"
    path.write_text(f"""
[run]
name = "resume-{schedule}"
out_dir = "{out_dir}"
seed = 3
log_level = "warning"
[model]
name = "{model}"
[trainer]
engine = "torch"
learning_rate = 1e-4
options = {{ routing_replay = true }}
[inference]
engine = "torch"
options = {{ enable_return_routed_experts = true }}
[env]
name = "math.arith"
[rl]
steps = {STEPS}
schedule = "{schedule}"
groups_per_batch = {GROUPS}
group_size = {GROUP_SIZE}
max_tokens = 8
{PPO if with_critic else ""}
[off_policy]
max_staleness = 2
correction = "token"
[eval]
every = 0
tasks = 1
samples_per_task = 1
[checkpoint]
every = 2
keep = {STEPS}
{CRITIC if with_critic else ""}""")
    return path


def attempt(config: Path, crash_at: str | None, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PLAIT_CACHE_DIR": str(cache)}
    env.pop(CRASH_ENV, None)
    if crash_at:
        env[CRASH_ENV] = crash_at
    return subprocess.run(
        [sys.executable, "-c", "from plait.cli import cli; cli()", "run", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


CRASHES = {
    # the first attempt dies before any checkpoint; later ones go back to step_2, then step_6.
    # The attempt resumed from step_6 dies training step 7, not sampling: under async, step_6
    # can hold every sample of steps 7 and 8 (sampled ahead), and that attempt then samples
    # nothing (a bare CI run finished it without reaching "rollout:7").
    "async": ["rollout:1", "trained:2", "sync:3", "checkpoint:4", "checkpointed:6", "trained:7"],
    "sync": ["rollout:1", "trained:2", "checkpoint:4", "checkpointed:6", "trained:7"],
}


@pytest.mark.parametrize("schedule", ["async", "sync"])
def test_sigkill_anywhere_trains_every_sample_exactly_once(schedule, tiny_moe, tmp_path):
    config = write_config(tmp_path / "run.toml", tiny_moe, tmp_path / "runs", schedule)
    run_dir = tmp_path / "runs" / f"resume-{schedule}"
    for crash_at in CRASHES[schedule]:
        result = attempt(config, crash_at, tmp_path / "cache")
        assert result.returncode == -signal.SIGKILL, (
            crash_at,
            result.returncode,
            result.stderr[-3000:],
        )
    result = attempt(config, None, tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-3000:]

    records = [json.loads(line) for line in (run_dir / LEDGER_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    trained = Counter((position, index) for r in records for position, index, *_ in r["samples"])
    expected = {(p, i) for p in range(STEPS * GROUPS) for i in range(GROUP_SIZE)}
    assert set(trained) == expected and set(trained.values()) == {1}, trained
    # step s trains positions [(s-1) * GROUPS, s * GROUPS), each the task the run's order puts there
    sampler = TaskSampler(_num_train_tasks(), seed=3)
    for r in records:
        for position, _index, task_index, _attempt, _digest in r["samples"]:
            assert position // GROUPS == r["step"] - 1
            assert task_index == sampler.index(position)
    assert (
        max(r["attempt"] for r in records) >= 2
    )  # the final attempt resumed twice: step_2, step_6
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step_{s:06d}" for s in range(2, STEPS + 1, 2)]  # no torn .tmp left
    if schedule == "async":
        # The samples a checkpoint held (sampled, not yet trained) were trained as sampled, not
        # sampled again, by the process that wrote it or by one resumed from it. How many there
        # are depends on timing; where they are, this holds.
        trained_attempts = {
            (position, index): (sample_attempt, r["attempt"])
            for r in records
            for position, index, _task, sample_attempt, _ in r["samples"]
        }
        digests = {
            (position, index): digest
            for r in records
            for position, index, *_, digest in r["samples"]
        }
        held_routing = 0
        for checkpoint in checkpoints:
            state = json.loads(
                (run_dir / "checkpoints" / checkpoint / "controller.json").read_text()
            )
            for held in state["completed"]:
                sampled_by, trained_by = trained_attempts[held["position"], held["index"]]
                assert sampled_by == held["attempt"] <= trained_by, (checkpoint, held)
                trajectory = from_json(Trajectory, held["trajectory"])
                for turn in trajectory.turns:
                    routing = turn.completion.routed_experts
                    assert routing.dtype == "uint8"
                    assert routing.shape == (
                        len(turn.prompt) + len(turn.completion.tokens) - 1,
                        2,
                        2,
                    )
                    held_routing += 1
                sample = TrainedSample(
                    held["position"], held["index"], held["task_index"], held["attempt"], trajectory
                )
                assert (
                    sample.ledger_entry()[-1] == digests[held["position"], held["index"]]
                )  # routing as sampled
        print(f"held samples with routing across checkpoints: {held_routing}")

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS + 1))  # 0: the evaluation before
    if schedule == "sync":
        assert all("critic/explained_variance" in m for m in metrics[1:])
        for checkpoint in checkpoints:  # the critic trained once a step, across every resume
            meta = run_dir / "checkpoints" / checkpoint / "critic" / "plait_trainer.json"
            assert json.loads(meta.read_text())["weight_version"] == int(checkpoint[5:])


def _num_train_tasks() -> int:
    import asyncio

    env = build("env", "math.arith")
    return asyncio.run(env.num_tasks("train"))
