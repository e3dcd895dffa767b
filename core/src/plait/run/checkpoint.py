"""Checkpoints, the ledger of what was trained, and fault injection for crash-safety tests.

A checkpoint (checkpoints/step_N) holds the trainer's state, the `RunState`, and the samples a
schedule had completed for batches not trained yet; it is written to a temporary directory,
fsynced and renamed into place, so a crash at any moment leaves the previous one or this one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Sequence
from pathlib import Path

import structlog

from plait.components import Policy
from plait.run.state import Run, TrainedSample
from plait.serde import from_json, to_json
from plait.trajectory import Trajectory

log = structlog.get_logger("plait.run")

CHECKPOINT_DIR = "checkpoints"
LEDGER_FILE = "trained.jsonl"
METRICS_FILE = "metrics.jsonl"
CRASH_ENV = "PLAIT_CRASH_AT"


def crash_point(point: str, step: int) -> None:
    """Fault injection: with PLAIT_CRASH_AT="<point>:<step>" the process SIGKILLs itself here
    (points: rollout, trained, sync, checkpoint, checkpointed)."""
    if os.environ.get(CRASH_ENV) == f"{point}:{step}":
        log.warning("crashing on purpose", point=point, step=step)
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_state(run: Run, held: Sequence[TrainedSample]) -> dict[str, object]:
    """What a checkpoint holds beside the trainer state (taken in the event loop, so that it is
    consistent; written by `save_checkpoint`, possibly in a thread)."""
    s = run.state
    return {
        "step": s.step,
        "samples_seen": s.samples_seen,
        "attempt": s.attempt,
        "weight_versions": {p.name: p.trainer.weight_version for p in run.components.policies},
        "eval_history": s.eval_history,
        "extra_prompts": s.extra_prompts,
        "completed": [
            {
                "position": h.position,
                "index": h.index,
                "task_index": h.task_index,
                "attempt": h.attempt,
                "trajectory": to_json(h.trajectory),
            }
            for h in held
        ],
    }


def trainer_dir(run: Run, policy: Policy) -> str:
    """A checkpoint's directory of one policy's trainer state."""
    return "trainer" if len(run.components.policies) == 1 else f"trainer-{policy.name}"


def save_checkpoint(run: Run, state: dict[str, object]) -> Path:
    """Trainer state and `state` under checkpoints/step_N, atomically; keeps the newest
    `checkpoint.keep`."""
    step = run.state.step
    root = run.run_dir / CHECKPOINT_DIR
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for policy in run.components.policies:
        policy.trainer.save_state(tmp / trainer_dir(run, policy))
    if run.components.critic is not None:
        run.components.critic.trainer.save_state(tmp / "critic")
    _write_synced(tmp / "controller.json", json.dumps(state))
    fsync_dir(tmp)
    crash_point("checkpoint", step)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_dir(root)
    crash_point("checkpointed", step)
    for old in sorted(root.glob("step_*"))[: -run.config.checkpoint.keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(run: Run) -> list[TrainedSample] | None:
    """Restore the newest checkpoint into `run` and return the samples it held (None when there
    is none). Metric and ledger records written after it are dropped."""
    root = run.run_dir / CHECKPOINT_DIR
    for leftover in root.glob(".tmp-step_*"):  # a save that a crash interrupted
        shutil.rmtree(leftover, ignore_errors=True)
    checkpoints = sorted(root.glob("step_*"))
    if not checkpoints:
        for name in (METRICS_FILE, LEDGER_FILE):  # leftovers of a run that saved nothing
            _truncate_records(run.run_dir / name, -1)
        return None
    latest = checkpoints[-1]
    state = json.loads((latest / "controller.json").read_text())
    for policy in run.components.policies:
        policy.trainer.load_state(latest / trainer_dir(run, policy))
    if run.components.critic is not None:
        run.components.critic.trainer.load_state(latest / "critic")
    s = run.state
    s.step = int(state["step"])
    s.samples_seen = int(state["samples_seen"])
    s.attempt = int(state.get("attempt", 0)) + 1
    s.eval_history = [(int(step), float(acc)) for step, acc in state.get("eval_history", [])]
    s.extra_prompts = int(state.get("extra_prompts", 0))
    for name in (METRICS_FILE, LEDGER_FILE):
        _truncate_records(run.run_dir / name, s.step)
    held = [
        TrainedSample(
            item["position"],
            item["index"],
            item["task_index"],
            item["attempt"],
            from_json(Trajectory, item["trajectory"]),
        )
        for item in state.get("completed", [])
    ]
    log.info(
        "resumed from checkpoint",
        checkpoint=str(latest),
        step=s.step,
        attempt=s.attempt,
        held_samples=len(held),
    )
    return held


def record_trained(run: Run, samples: Sequence[TrainedSample], weight_version: int) -> None:
    """Append what this step trained on (at `weight_version`) to trained.jsonl, numbered as its
    metrics (the step count after it); truncated with them on resume, so it lists exactly what
    the checkpointed weights have seen."""
    record = {
        "step": run.state.step + 1,
        "weight_version": weight_version,
        "attempt": run.state.attempt,
        "samples": [
            s.ledger_entry() for s in samples
        ],  # and which replica sampled each turn (pools):
        "replicas": [[turn.completion.replica for turn in s.trajectory.turns] for s in samples],
    }
    with (run.run_dir / LEDGER_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_records(path: Path, step: int) -> None:
    """Drop records after `step` (written by a run that died after its last checkpoint)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if _record_step(line) <= step]
    path.write_text("".join(line + "\n" for line in kept))


def _record_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # torn line: drop it


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
