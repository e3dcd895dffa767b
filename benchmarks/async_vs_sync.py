"""Async against sync RL on a rollout-bound workload: samples trained per second, side by side.

The same run config (default: examples/arith_tiny.toml, tiny-qwen3-arith on math.arith's tiny
preset) is trained twice on the same machine, once with `rl.schedule = "sync"` (sample, train,
sync weights, in turn) and once with `rl.schedule = "async"` (sampling runs on while the trainer
trains, at most `--max-staleness` weight versions behind, weights updated in flight, token-level
truncated importance sampling). The environment is made slow (`benchmarks/slow_env.py`: every
tool call, here the answer check, waits `--env-delay-s`, as a remote verifier or sandbox would),
so rollout, not training, bounds the sync schedule.

Reported per schedule: samples trained per second (samples / the summed `time/total` of the
training steps, evaluations excluded), reward over the first and last steps, the largest
staleness and importance weight seen, and the trainer's stall time; and the async/sync ratio.

    python benchmarks/async_vs_sync.py [--config examples/arith_tiny.toml] [--steps 20]
        [--env-delay-s 10]

Writes benchmarks/results/async_vs_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["PLAIT_PLUGIN_MODULES"] = ",".join(
    filter(None, [os.environ.get("PLAIT_PLUGIN_MODULES"), "slow_env"])
)

from plait.config import RunConfig, load_config  # noqa: E402
from plait.logs import configure_logging  # noqa: E402
from plait.run.loop import run_training  # noqa: E402


def variant(base: RunConfig, schedule: str, args: argparse.Namespace, out_dir: Path) -> RunConfig:
    env = attrs.evolve(
        base.env,
        name="bench.slow",
        options={
            "inner": base.env.name,
            "inner_options": dict(base.env.options),
            "delay_s": args.env_delay_s,
        },
    )
    return attrs.evolve(
        base,
        run=attrs.evolve(
            base.run, name=f"async-vs-sync-{schedule}", out_dir=str(out_dir), log_level="warning"
        ),
        env=env,
        rl=attrs.evolve(
            base.rl, schedule=schedule, steps=args.steps, groups_per_batch=args.groups_per_batch
        ),
        off_policy=attrs.evolve(
            base.off_policy,
            max_staleness=args.max_staleness,
            correction="token",
            truncate=2.0,
            mask_above=10.0,
        ),
        eval=attrs.evolve(base.eval, every=0, tasks=args.eval_tasks),
        metrics=attrs.evolve(base.metrics, sinks=["jsonl"], options={}),
    )


def measure(config: RunConfig) -> dict[str, Any]:
    started = time.perf_counter()
    run_training(config, resume=False)
    wall = time.perf_counter() - started
    run_dir = Path(config.run.out_dir) / config.run.name
    steps = [
        m
        for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if m["step"] > 0
    ]
    samples = config.rl.steps * config.rl.groups_per_batch * config.rl.group_size
    seconds = sum(m["time/total"] for m in steps)
    rewards = [m["reward/mean"] for m in steps]
    head = max(1, len(rewards) // 4)
    evals = [
        m["eval/accuracy"]
        for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "eval/accuracy" in m
    ]
    return {
        "schedule": config.rl.schedule,
        "steps": config.rl.steps,
        "samples": samples,
        "train_loop_seconds": seconds,
        "process_seconds": wall,
        "samples_trained_per_s": samples / seconds,
        "reward_first_steps": sum(rewards[:head]) / head,
        "reward_last_steps": sum(rewards[-head:]) / head,
        "reward_by_step": rewards,
        "eval_accuracy_start_end": [evals[0], evals[-1]],
        "staleness_max": max(m.get("async/staleness_max", 0.0) for m in steps),
        "staleness_mean": sum(m.get("async/staleness_mean", 0.0) for m in steps) / len(steps),
        "importance_weight_max": max(m.get("policy/importance_weight_max", 1.0) for m in steps),
        "is_masked_fraction_max": max(m.get("policy/is_masked_fraction", 0.0) for m in steps),
        "stall_seconds": sum(m.get("time/stall", 0.0) for m in steps),
        "rollout_seconds": sum(m.get("time/rollout", 0.0) for m in steps),
        "train_seconds": sum(m.get("time/train", 0.0) for m in steps),
        "sync_seconds": sum(m.get("time/sync", 0.0) for m in steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "arith_tiny.toml")
    parser.add_argument(
        "--steps", type=int, default=20
    )  # enough for reward to rise in both schedules
    parser.add_argument("--groups-per-batch", type=int, default=8)
    parser.add_argument("--env-delay-s", type=float, default=10.0)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--eval-tasks", type=int, default=16)
    parser.add_argument(
        "-s", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "async_vs_sync.json"
    )
    args = parser.parse_args()
    base = load_config(args.config, args.overrides)
    configure_logging("warning")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in ("sync", "async"):
            results[schedule] = measure(variant(base, schedule, args, Path(tmp)))
            r = results[schedule]
            print(
                f"{schedule:>5}: {r['samples_trained_per_s']:.2f} samples/s, reward "
                f"{r['reward_first_steps']:.3f} -> {r['reward_last_steps']:.3f}, staleness max "
                f"{r['staleness_max']:g}, IS weight max {r['importance_weight_max']:.3f}, "
                f"stall {r['stall_seconds']:.1f} s",
                flush=True,
            )
    ratio = results["async"]["samples_trained_per_s"] / results["sync"]["samples_trained_per_s"]
    print(f"async / sync throughput: {ratio:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "async_vs_sync",
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "config": str(
                    args.config.relative_to(ROOT)
                    if args.config.is_relative_to(ROOT)
                    else args.config
                ),
                "overrides": args.overrides,
                "env_delay_s": args.env_delay_s,
                "max_staleness": args.max_staleness,
                "model": base.model.name,
                "groups_per_batch": args.groups_per_batch,
                "group_size": base.rl.group_size,
                "async_over_sync_samples_per_s": ratio,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
