"""plait against a minimal hand-written GRPO loop (benchmarks/minimal_grpo.py) on the same work.

Both sides run the step of benchmarks/grpo_workload.py (SmolLM2-135M-Instruct, 8 prompts x 8
samples, 8 new tokens, AdamW 2e-5, clipping at 1) on the same prompts in the same order: the
tasks are written in plait's task order (its seeded `TaskSampler`), and plait's ledger
(trained.jsonl) is checked against them afterwards. Each side is its own subprocess of this venv,
one after the other, so both start cold, neither holds the other's memory, and one's threads do
not compete with the other's. Each side runs `--repeats` times (default 3), the order alternating
(minimal, plait; plait, minimal; ...): this machine's speed drifts by tens of percent over minutes
(a single pair measured 1.15x and 1.43x an hour apart), and pooling alternating runs evens it out.

- minimal: `minimal_grpo.py --json`; its per-step sampling (with the reward), train (advantages,
  forward/backward, optimizer step) and total wall times.
- plait: `plait run` on grpo_workload.plait_config (evaluation only before and after training);
  per step from <run dir>/metrics.jsonl: time/total (which excludes evaluation: time/eval is
  measured apart), time/rollout (with the reward), time/train (advantages and data, forward/
  backward, optimizer step), time/sync (weights to the inference engine) and the rest.

Reported per side: median step, sampling and train times over every run's steps after its first
(a warm-up), the ratio plait / minimal of those pooled medians, each repeat's own step ratio (their
spread is the benchmark's noise), and the learning curve (reward/mean per step; means of the first
and last five steps; each side is seeded, so its repeats learn alike). Train time grows with the
groups that train (those whose rewards differ), which differ between the sides, so a fit of train
time = fixed + per group x kept groups is reported too, with both sides' fitted times at the same
number of kept groups. Rewards differ sample by sample (each side draws its own random numbers)
but follow the same distribution.

    python benchmarks/vs_minimal.py [--steps 20] [--repeats 3] [--threads N] [--order minimal,plait]
                                      [--train tree] [--plait-set KEY=VALUE ...]

On a machine that something else also loads, pass --threads 1 (to both sides): torch's default
of one thread per core stalls at every parallel region when a core is taken, by several times.

Writes benchmarks/results/vs_minimal.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpo_workload as workload
from engine_bench import RESULTS, machine, median

HERE = Path(__file__).resolve().parent
# The environment as started: discovering plait's plugins in this process (writing the tasks)
# sets plait-torch's OpenMP defaults in os.environ, which the hand-written loop must not inherit.
STARTING_ENV = dict(os.environ)
VENV_BIN = Path(sys.executable).parent


def write_tasks_in_plait_order(path: Path, steps: int) -> list[int]:
    """grpo_workload.write_tasks' rows, for the task indices plait's run visits: position p of
    the run is task TaskSampler(...).index(p). Returns those indices."""
    from plait.run.state import TaskSampler
    from plait_math.arith import ArithOptions, make_env

    env = make_env(options=ArithOptions(**workload.ENV_OPTIONS))

    async def rows() -> tuple[list[int], list[dict[str, Any]]]:
        indices = TaskSampler(await env.num_tasks("train"), workload.SEED).batch(
            0, steps * workload.GROUPS
        )
        out = []
        for index in indices:
            task = await env.get_task("train", index)
            session = await env.open(task)
            messages = await session.messages()
            await session.close()
            out.append(
                {
                    "messages": [{"role": m.role, "content": m.content} for m in messages],
                    "answer": task["answer"],
                }
            )
        return indices, out

    indices, tasks = asyncio.run(rows())
    path.write_text("".join(json.dumps(row) + "\n" for row in tasks))
    return indices


def child_env(threads: int | None) -> dict[str, str]:
    env = dict(STARTING_ENV)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def run_minimal(work: Path, tasks: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = work / "minimal.json"
    command = [
        str(VENV_BIN / "python"),
        str(HERE / "minimal_grpo.py"),
        "--model-dir",
        str(workload.model_dir()),
        "--tasks",
        str(tasks),
        "--steps",
        str(args.steps),
        "--seed",
        str(workload.SEED),
        "--train",
        args.train,
        "--json",
        str(out),
    ]
    if args.threads:
        command += ["--threads", str(args.threads)]
    start = time.perf_counter()
    subprocess.run(command, check=True, env=child_env(args.threads))
    result = json.loads(out.read_text())
    steps = len(result["step_s"])
    return {
        "process_s": time.perf_counter() - start,
        "threads": result["threads"],
        "train_layout": result["train"],
        "step_s": result["step_s"],
        "sample_s": result["sample_s"],
        "train_s": result["train_s"],
        "other_s": [0.0] * steps,
        "reward": result["reward"],
        "groups_kept": result["groups_kept"],
        "logprob_mismatch_max": result["mismatch_max"],
    }


def run_plait(work: Path, indices: list[int], args: argparse.Namespace) -> dict[str, Any]:
    name = "vs-minimal"
    config = work / "plait.toml"
    config.write_text(workload.plait_config(work / "plait", name, args.steps))
    start = time.perf_counter()
    subprocess.run(
        workload.plait_command(config, args.threads, args.plait_set),
        check=True,
        env=child_env(args.threads),
    )
    process_s = time.perf_counter() - start
    run_dir = work / "plait" / name
    rows = workload.plait_steps(run_dir, args.steps)
    ledger = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    trained = sorted({(s[0], s[2]) for entry in ledger for s in entry["samples"]})
    if [task for _, task in trained] != indices:
        raise SystemExit(
            "plait trained on other tasks than the minimal loop: "
            f"{trained[:4]}... vs {indices[:4]}..."
        )
    times = {
        key: [r.get(f"time/{key}", 0.0) for r in rows]
        for key in ("total", "rollout", "train", "sync")
    }
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "process_s": process_s,
        "step_s": times["total"],
        "sample_s": times["rollout"],
        "train_s": times["train"],
        "sync_s": times["sync"],
        "other_s": [
            t - r - tr - s
            for t, r, tr, s in zip(
                times["total"], times["rollout"], times["train"], times["sync"], strict=True
            )
        ],
        "reward": [r["reward/mean"] for r in rows],
        "groups_kept": [r.get("data/groups_kept", 0.0) for r in rows],
        "eval_accuracy_start_end": [summary["eval_accuracy_start"], summary["eval_accuracy_end"]],
        "time_keys": {
            k: [r.get(k) for r in rows]
            for k in sorted({k for r in rows for k in r})
            if k.startswith(("time/", "sync/seconds", "data/", "perf/"))
        },
    }


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's repeats as one: the per-step lists of every run after its first (warm-up) step,
    end to end; the learning curve of the first run (each side is seeded: its runs learn alike)."""
    keys = ("step_s", "sample_s", "train_s", "sync_s", "other_s", "groups_kept")
    merged = {key: [v for run in runs for v in run[key][1:]] for key in keys if key in runs[0]}
    return {
        **merged,
        "reward": runs[0]["reward"],
        "groups_kept_all": [k for run in runs for k in run["groups_kept"]],
    }


def summarize(side: dict[str, Any]) -> dict[str, Any]:
    """Medians of a pooled side (see `pooled`: warm steps only), a train-time fit, the learning
    curve."""
    rewards = side["reward"]
    # Train time grows with the kept groups (those with unequal rewards), which differ between the
    # sides' samples: a least-squares fit train_s = fixed + per_group * kept (steps that trained).
    points = [(k, t) for k, t in zip(side["groups_kept"], side["train_s"], strict=True) if k]
    try:
        fit = statistics.linear_regression([k for k, _ in points], [t for _, t in points])
        per_group, fixed = fit.slope, fit.intercept
    except statistics.StatisticsError:  # fewer than two distinct counts
        per_group = fixed = float("nan")
    return {
        key.replace("_s", "_median_s"): median(side[key])
        for key in ("step_s", "sample_s", "train_s", "sync_s", "other_s")
        if key in side
    } | {
        "train_fit_fixed_s": fixed,
        "train_fit_per_group_s": per_group,
        "groups_kept_mean": statistics.fmean(side["groups_kept_all"]),
        "reward_first5": sum(rewards[:5]) / len(rewards[:5]),
        "reward_last5": sum(rewards[-5:]) / len(rewards[-5:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads on both sides (default: torch's)"
    )
    parser.add_argument(
        "--order",
        default="minimal,plait",
        choices=("minimal,plait", "plait,minimal"),
        help="which side runs first in the first repeat (the order alternates)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each side, alternating which goes first: this machine's speed drifts by "
        "tens of percent over minutes, and pairs run back to back see the same drift",
    )
    parser.add_argument(
        "--train",
        choices=("tree", "padded"),
        default="tree",
        help="the minimal loop's training layout (see minimal_grpo.py)",
    )
    parser.add_argument(
        "--plait-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override of plait's run config (plait run -s), e.g. rl.micro_batch_size=64",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory (plait's run dir)"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plait-vs-minimal-"))
    tasks = work / "tasks.jsonl"
    indices = write_tasks_in_plait_order(tasks, args.steps)
    runs: dict[str, list[dict[str, Any]]] = {"minimal": [], "plait": []}
    order = args.order.split(",")
    for repeat in range(args.repeats):
        for side in order if repeat % 2 == 0 else order[::-1]:
            print(f"== {side} (repeat {repeat + 1} of {args.repeats})", flush=True)
            runs[side].append(
                run_minimal(work, tasks, args)
                if side == "minimal"
                else run_plait(work, indices, args)
            )
    # Each repeat's step-time ratio: the spread of these is the benchmark's own noise.
    pair_ratios = [
        median(p["step_s"][1:]) / median(m["step_s"][1:])
        for m, p in zip(runs["minimal"], runs["plait"], strict=True)
    ]
    sides = {side: runs[side][0] for side in runs}  # the per-step record of the first repeat
    summary = {side: summarize(pooled(runs[side])) for side in ("minimal", "plait")}
    kept = (summary["minimal"]["groups_kept_mean"] + summary["plait"]["groups_kept_mean"]) / 2
    for side in summary.values():  # the fitted train time at the same number of kept groups
        side["train_fit_at_equal_kept_s"] = (
            side["train_fit_fixed_s"] + side["train_fit_per_group_s"] * kept
        )
    ratios = {
        key.removesuffix("_s").removesuffix("_median"): summary["plait"][key]
        / summary["minimal"][key]
        for key in (
            "step_median_s",
            "sample_median_s",
            "train_median_s",
            "train_fit_at_equal_kept_s",
        )
        if summary["minimal"][key]
    }

    print(
        f"\n{args.repeats} x {args.steps} steps per side; "
        f"medians over steps 2..{args.steps} of every run (seconds)"
    )
    print(
        f"{'':10}{'step':>7}{'sampling':>10}{'train':>7}{'sync':>6}{'other':>7}{'kept':>6}"
        f"{'train fit':>16}{'reward 1-5':>12}{'last 5':>8}"
    )
    for side in ("minimal", "plait"):
        s = summary[side]
        fit = f"{s['train_fit_fixed_s']:.2f}+{s['train_fit_per_group_s']:.2f}k"
        print(
            f"{side:10}{s['step_median_s']:7.2f}{s['sample_median_s']:10.2f}"
            f"{s['train_median_s']:7.2f}{s.get('sync_median_s', 0.0):6.2f}"
            f"{s['other_median_s']:7.2f}{s['groups_kept_mean']:6.1f}{fit:>16}"
            f"{s['reward_first5']:12.3f}{s['reward_last5']:8.3f}"
        )
    print(
        "(kept: mean groups with unequal rewards, which train; "
        "train fit: seconds = fixed + per group x k; "
        f"at equal kept = {kept:.1f}: "
        f"minimal {summary['minimal']['train_fit_at_equal_kept_s']:.2f}s, "
        f"plait {summary['plait']['train_fit_at_equal_kept_s']:.2f}s)"
    )
    print("plait / minimal: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print("step ratio of each repeat: " + ", ".join(f"{r:.2f}x" for r in pair_ratios))
    for side in ("minimal", "plait"):
        print(
            f"reward/mean per step, {side}: " + " ".join(f"{r:.2f}" for r in sides[side]["reward"])
        )

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "vs_minimal.json"
    settings = {
        "steps": args.steps,
        "repeats": args.repeats,
        "threads": args.threads,
        "order": args.order,
        "minimal_train": args.train,
        "plait_overrides": args.plait_set,
        "groups": workload.GROUPS,
        "group_size": workload.GROUP_SIZE,
        "max_tokens": workload.MAX_TOKENS,
        "learning_rate": workload.LEARNING_RATE,
        "model": workload.MODEL,
    }
    path.write_text(
        json.dumps(
            {
                "machine": machine(),
                "settings": settings,
                "summary": summary,
                "ratios": ratios,
                "step_ratio_per_repeat": pair_ratios,
                "per_step": sides,
                "step_s_per_repeat": {side: [run["step_s"] for run in runs[side]] for side in runs},
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {path}")
    if not args.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"work directory: {work}")


if __name__ == "__main__":
    main()
