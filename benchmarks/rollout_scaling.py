"""Rollout capacity growing with the environment pool in one run: 1 -> 2 -> 4 members, then 1.

The test-sized example (examples/arith_tiny.toml) runs with env.name = "pool": math.arith on ORS
servers (`plait env serve`, launched by the run) whose answer check takes --verify-seconds (a
slow verifier), each member running at most --cap episodes at once, so a step's rollout is
bounded by members x cap. The run starts with one member; each time --steps-per-size more steps
are done (metrics.jsonl), the benchmark asks for the next size with `plait scale RUN_DIR env=N`.
It reports samples per second of rollout (a step's samples / its time/rollout) for the steps of
each size (the first step after a change is left out: members join or drain during it), the
ratio to one member, and, after the scale-down, that every sample of every step was trained
exactly once (the run's trained.jsonl).

    python benchmarks/rollout_scaling.py [--steps-per-size 3] [--verify-seconds 0.5] [--cap 4]

Writes benchmarks/results/rollout_scaling.json.
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
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1, 2, 4, 1)


def steps_done(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    return [
        m
        for m in (json.loads(line) for line in metrics.read_text().splitlines() if line.strip())
        if m["step"] > 0
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "arith_tiny.toml")
    parser.add_argument("--steps-per-size", type=int, default=3)
    parser.add_argument("--verify-seconds", type=float, default=0.5)
    parser.add_argument("--cap", type=int, default=4, help="episodes one member runs at once")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "rollout_scaling.json"
    )
    args = parser.parse_args()
    steps = args.steps_per_size * len(SIZES)

    with tempfile.TemporaryDirectory(prefix="rollout-scaling-") as scratch:
        out_dir = Path(scratch)
        run_dir = out_dir / "scaling"
        pool = (
            '{env = "math.arith", '
            f'env_options = {{preset = "tiny", verify_seconds = {args.verify_seconds}}}, '
            f"members = {SIZES[0]}, max_in_flight = {args.cap}, "
            f'scale_file = "{out_dir / "env-scale.json"}", '
            f"poll_s = 0.2}}"
        )
        argv = [sys.executable, "-m", "plait.cli", "run", str(args.config), "--no-resume"]
        for item in [
            f"run.out_dir={out_dir}",
            "run.name=scaling",
            f"rl.steps={steps}",
            "eval.every=0",
            "run.log_level=warning",
            "env.name=pool",
            f"env.options={pool}",
        ]:
            argv += ["-s", item]
        log = (out_dir / "run.log").open("wb")
        run = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        size_of_step: dict[int, int] = {}
        started = time.monotonic()
        for index, size in enumerate(SIZES):
            if index:
                while len(steps_done(run_dir / "metrics.jsonl")) < index * args.steps_per_size:
                    if run.poll() is not None:
                        raise RuntimeError(
                            f"the run ended early: {(out_dir / 'run.log').read_text()[-3000:]}"
                        )
                    time.sleep(0.2)
                subprocess.run(
                    [sys.executable, "-m", "plait.cli", "scale", str(run_dir), f"env={size}"],
                    check=True,
                )
                print(f"{time.monotonic() - started:6.1f} s: asked for {size} members", flush=True)
            for step in range(
                index * args.steps_per_size + 1, (index + 1) * args.steps_per_size + 1
            ):
                size_of_step[step] = size
        if run.wait() != 0:
            raise RuntimeError(f"the run failed: {(out_dir / 'run.log').read_text()[-3000:]}")
        metrics = steps_done(run_dir / "metrics.jsonl")
        records = [
            json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()
        ]
        config = tomllib.loads((run_dir / "config.toml").read_text())["rl"]

    samples_per_step = config["groups_per_batch"] * config["group_size"]
    trained = Counter((position, index) for r in records for position, index, *_ in r["samples"])
    expected = {
        (p, i)
        for p in range(steps * config["groups_per_batch"])
        for i in range(config["group_size"])
    }
    exactly_once = set(trained) == expected and set(trained.values()) == {1}
    phases = []
    for index, size in enumerate(SIZES):
        first = index * args.steps_per_size + 1
        measured = [
            m for m in metrics if first < m["step"] <= first + args.steps_per_size - 1
        ]  # not the change's step
        rates = [samples_per_step / m["time/rollout"] for m in measured]
        phases.append(
            {
                "members": size,
                "steps": [m["step"] for m in measured],
                "samples_per_s": statistics.median(rates),
                "per_step": rates,
                "env_errors": sum(m.get("env/errors", 0) for m in measured),
            }
        )
        print(
            f"{size} member(s): {statistics.median(rates):6.1f} samples/s of rollout "
            f"(steps {[m['step'] for m in measured]})",
            flush=True,
        )
    base = phases[0]["samples_per_s"]
    result = {
        "benchmark": "rollout_scaling",
        "config": str(args.config.relative_to(ROOT)),
        "settings": {
            "steps_per_size": args.steps_per_size,
            "verify_seconds": args.verify_seconds,
            "cap_per_member": args.cap,
            "samples_per_step": samples_per_step,
            "sizes": SIZES,
        },
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "phases": phases,
        "speedup_over_one_member": [p["samples_per_s"] / base for p in phases],
        "every_sample_trained_exactly_once": exactly_once,
        "time_rollout_by_step": {m["step"]: m["time/rollout"] for m in metrics},
        "members_by_step": size_of_step,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"samples/s by members {[p['members'] for p in phases]}: "
        f"{', '.join(f'{r:.2f}x' for r in result['speedup_over_one_member'])} of one member; "
        f"every sample trained exactly once: {exactly_once} -> {args.out}"
    )


if __name__ == "__main__":
    main()
