"""Step time of this checkout against an earlier commit on the same config, every new switch off:
runs of the two alternate (A B A B ...), so that the machine's load falls on both alike.

The earlier commit is checked out into a temporary git worktree and run by this interpreter with
the worktree's source folders first on PYTHONPATH (this venv's packages otherwise; the installed
distributions' entry points name modules, which then load from the worktree). Each run is
`plait run CONFIG -s rl.steps=N` with evaluation only before and after; the time of a step is its
`time/total` (sampling, training, sync), the first step left out (warm-up). Writes
benchmarks/results/step_time.json (or `--output`).

    python benchmarks/step_time.py --baseline a6c2327 [--runs 3] [--steps 10] [--config ...]
        [--output step_time_906a449.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEMO = ROOT / "examples" / "arith_smollm2.toml"
SOURCE_FOLDERS = ("core", "libs/*", "plugins/*", "envs/*", "renderers/*", "sdk")


def source_path(checkout: Path) -> str:
    """The checkout's package source folders, as PYTHONPATH."""
    folders = [src for pattern in SOURCE_FOLDERS for src in sorted(checkout.glob(f"{pattern}/src"))]
    return os.pathsep.join(str(f) for f in folders)


def one_run(
    checkout: Path, config: Path, steps: int, overrides: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A run of `config` (with `overrides`) by the code of `checkout`: its per-step times."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "PYTHONPATH": source_path(checkout)}
        command = [sys.executable, "-m", "plait.cli", "run", str(config), "--no-resume"]
        fixed = (f"rl.steps={steps}", "eval.every=0", "eval.tasks=8", f"run.out_dir={out}")
        for override in (*fixed, *overrides):
            command += ["-s", override]
        began = time.time()
        done = subprocess.run(command, capture_output=True, text=True, cwd=checkout, env=env)
        if done.returncode:
            raise RuntimeError(f"the run of {checkout} failed:\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for p in Path(out).glob("*/metrics.jsonl") for line in p.open()]
    steps_rows = sorted((r for r in rows if "time/total" in r), key=lambda r: r["step"])
    return {
        "wall_seconds": time.time() - began,
        "total": [r["time/total"] for r in steps_rows],
        "train": [r["time/train"] for r in steps_rows],
        "rollout": [r["time/rollout"] for r in steps_rows],
    }


def described_head() -> str:
    """This checkout's commit, "-dirty" when it has changes."""
    return subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(t for run in runs for t in run[key][1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the earlier commit")
    parser.add_argument("--config", type=Path, default=DEMO)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--output", default="step_time.json", help="its name in results/")
    args = parser.parse_args()
    head = described_head()
    with tempfile.TemporaryDirectory() as tmp:
        baseline = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(baseline), args.baseline],
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        try:
            sides: dict[str, list[dict[str, Any]]] = {"baseline": [], "head": []}
            for n in range(args.runs):
                for side, checkout in (("baseline", baseline), ("head", ROOT)):
                    run = one_run(checkout, args.config, args.steps)
                    sides[side].append(run)
                    print(
                        f"[{n + 1}/{args.runs}] {side}: median step "
                        f"{statistics.median(run['total'][1:]):.2f} s",
                        flush=True,
                    )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT)
    result = {
        "what": __doc__.split("\n\n")[0],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": str(args.config.relative_to(ROOT)),
        "baseline": args.baseline,
        "head": head,
        "steps": args.steps,
        "runs": sides,
        "median_step_seconds": {
            side: {key: median_of(runs, key) for key in ("total", "train", "rollout")}
            for side, runs in sides.items()
        },
    }
    medians = result["median_step_seconds"]
    result["head_over_baseline"] = {
        key: medians["head"][key] / medians["baseline"][key]
        for key in ("total", "train", "rollout")
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / args.output).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["head_over_baseline"], indent=1))


if __name__ == "__main__":
    main()
