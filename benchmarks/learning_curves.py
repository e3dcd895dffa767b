"""Shared by the learning benchmarks (`algorithms.py`, `four_doors.py`): one `plait run` of a
config with overrides, and its held-out accuracy curve against steps, samples and seconds."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


TRACKED = (
    "reward/mean",
    "critic/explained_variance",
    "critic/explained_variance_first_token",
    "critic/explained_variance_last_token",
)
"""Step metrics kept per step beside the curve, where a run reports them."""


def run_curve(config: Path, overrides: list[str], what: str) -> dict[str, Any]:
    """`plait run config -s override...` in a temporary run directory: the held-out accuracy
    at every evaluation (before training and every `eval.every` steps) with the samples and
    seconds of training steps so far, the TRACKED metrics of every step, and the run's wall
    time. `what` names the run in errors."""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "plait.cli", "run", str(config), "--no-resume"]
        for override in [*overrides, f"run.out_dir={out}"]:
            command += ["-s", override]
        began = time.time()
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
        rows = [
            json.loads(line) for path in Path(out).glob("*/metrics.jsonl") for line in path.open()
        ]
    curve, samples, seconds = [], 0.0, 0.0
    tracked: dict[str, list[float]] = {key: [] for key in TRACKED}
    for row in sorted(rows, key=lambda r: r.get("step", 0)):
        for key in TRACKED:
            if key in row:
                tracked[key].append(row[key])
        samples = row.get("progress/samples", samples)
        seconds += row.get("time/total", 0.0)
        if "eval/accuracy" in row:
            curve.append(
                {
                    "step": row.get("step", 0),
                    "samples": samples,
                    "train_seconds": seconds,
                    "accuracy": row["eval/accuracy"],
                }
            )
    return {
        "curve": curve,
        "per_step": {key: values for key, values in tracked.items() if values},
        "final_accuracy": curve[-1]["accuracy"] if curve else None,
        "wall_seconds": time.time() - began,
    }
