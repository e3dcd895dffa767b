"""Which RL algorithm learns fastest, on the same model, tasks and budget: every algorithm x task
x seed is a real `plait run` (SmolLM2-135M-Instruct by default), and its held-out accuracy is
recorded against training steps, samples and seconds.

The grid is resumable: runs already in the JSON are skipped, so it can be filled over several
sittings (each run takes a few minutes on 2 CPU cores). Every algorithm runs the same number of
steps of the same batch (groups_per_batch x group_size samples); dynamic sampling (dapo) samples
more per step, which its curve against samples shows. Writes
benchmarks/results/algorithms.json (one row per run: algorithm, task, seed, curve) and
benchmarks/results/algorithms.png (held-out accuracy against samples and against seconds, the
mean over seeds, and ppo+critic's critic's explained variance at each step: one row of panels
per task).

    python benchmarks/algorithms.py [--algorithms grpo dr_grpo ...] [--tasks sums ...]
        [--seeds 0 1] [--steps N] [--again] [--table]

`--again` runs the chosen runs even where the JSON has them, replacing their rows. `--table`
prints each task's table for docs/algorithms.md from the JSON instead.

Needs plait-torch, plait-math and plait-algorithms.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from learning_curves import ROOT, run_curve

RESULTS = ROOT / "benchmarks" / "results"
DEMO = ROOT / "examples" / "arith_smollm2.toml"

ALGORITHMS: dict[str, list[str]] = {
    "grpo": ["rl.advantage=grpo"],
    "dr_grpo": ["rl.advantage=dr_grpo"],
    "rloo": ["rl.advantage=rloo"],
    "reinforce++": ['rl.advantage="reinforce++"'],
    "gspo": ["rl.loss=gspo", "rl.loss_aggregation=sequence_mean"],
    "dapo": [
        "rl.loss=ppo",
        "rl.loss_config.clip_low_threshold=0.8",
        "rl.loss_config.clip_high_threshold=1.28",
        "rl.dynamic_sampling=true",
        "rl.loss_aggregation=token_mean",
    ],
    "grpo+kl": ["rl.kl.coef=0.1", "rl.kl.estimator=k3", "trainer.options.reference=true"],
    "ppo+critic": [
        "rl.loss=ppo",
        "rl.advantage=gae",
        "rl.advantage_options.lam=0.95",
        "rl.remove_constant_reward_groups=false",
        "critic.trainer.options.value_head=true",
        "critic.trainer.learning_rate=3e-5",
        "critic.updates=4",
    ],
}
"""Each algorithm as overrides of the task's config (`plait run -s`)."""

TASKS: dict[str, tuple[Path, list[str], int]] = {
    # Single-digit a + b after three worked examples (the demo): held-out accuracy starts at 0.19.
    "sums": (DEMO, [], 20),
    # Numbers of one or two digits: the same format, held-out accuracy starts at 0.08.
    "sums_2digit": (DEMO, ["env.options.max_digits=2"], 20),
    # reasoning-gym's basic_arithmetic through its own prompt, answer tags and scorer, three
    # worked examples first: held-out accuracy starts at 0.39.
    "rg_sums": (ROOT / "examples" / "reasoning_gym_smollm2.toml", [], 20),
    # math.calculator, multi-turn: 2-3 digit sums of products that the model answers by calling
    # the calculator tool, after one worked example; held-out accuracy starts at 0 (greedy, it
    # answers without the tool) and sampling calls it now and then. Its episodes are two model
    # turns of ~350-token prompts, so the example's fewer, smaller steps: 8 of 4 x 8, evaluated
    # on 32 tasks every 2.
    "calculator": (ROOT / "examples" / "calculator_smollm2.toml", [], 8),
}
"""Each task as a run config, overrides and its number of steps (`--steps` sets every task's)."""


def run_one(algorithm: str, task: str, seed: int, steps: int) -> dict[str, Any]:
    """One `plait run` and its held-out accuracy curve."""
    config, task_overrides, _ = TASKS[task]
    overrides = [*task_overrides, *ALGORITHMS[algorithm], f"rl.steps={steps}", f"run.seed={seed}"]
    return {
        "algorithm": algorithm,
        "task": task,
        "seed": seed,
        "steps": steps,
        "overrides": overrides,
        **run_curve(config, overrides, f"{algorithm} on {task} (seed {seed})"),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows})
    figure, axes = plt.subplots(len(tasks), 3, figsize=(16.5, 4 * len(tasks)), squeeze=False)
    for (by_samples, by_seconds, critic), task in zip(axes, tasks, strict=True):
        plot_explained_variance(critic, [r for r in rows if r["task"] == task], task)
        for algorithm in ALGORITHMS:
            runs = [r for r in rows if r["task"] == task and r["algorithm"] == algorithm]
            if not runs:
                continue
            points = min(len(r["curve"]) for r in runs)
            accuracy = [
                statistics.fmean(r["curve"][i]["accuracy"] for r in runs) for i in range(points)
            ]
            for ax, key in ((by_samples, "samples"), (by_seconds, "train_seconds")):
                x = [statistics.fmean(r["curve"][i][key] for r in runs) for i in range(points)]
                ax.plot(x, accuracy, marker="o", label=f"{algorithm} ({len(runs)} seeds)")
        for ax, label in ((by_samples, "samples"), (by_seconds, "seconds of training steps")):
            ax.set_title(f"{task}: held-out accuracy against {label}")
            ax.set_xlabel(label)
            ax.set_ylabel("held-out accuracy (greedy)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


EXPLAINED_VARIANCE = {
    "critic/explained_variance": "every action token",
    "critic/explained_variance_last_token": "each sample's last action token",
    "critic/explained_variance_first_token": "each sample's first action token",
}
"""The critic's explained variance over which tokens, as plotted."""


def plot_explained_variance(ax: Any, rows: list[dict[str, Any]], task: str) -> None:
    """The critic's explained variance at each step, the median over the runs that report it (a
    step whose returns hardly vary can give one run a large negative figure)."""
    for key, label in EXPLAINED_VARIANCE.items():
        runs = [r["per_step"][key] for r in rows if key in r.get("per_step", {})]
        if runs:
            steps = min(len(run) for run in runs)
            median = [statistics.median(run[i] for run in runs) for i in range(steps)]
            ax.plot(range(1, steps + 1), median, marker=".", label=f"{label} ({len(runs)} seeds)")
    ax.axhline(0, color="grey", linewidth=0.8)
    ax.set_title(f"{task}: ppo+critic's critic, explained variance")
    ax.set_xlabel("step")
    ax.set_ylabel("1 - Var(R - V) / Var(R), median of seeds")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def table(rows: list[dict[str, Any]], task: str, bar: float = 0.9) -> str:
    """The task's runs as the markdown table of docs/algorithms.md: per algorithm, held-out
    accuracy at the start and the end of each seed's run, their mean, the samples each took to
    reach `bar` ("-": never) and its seconds of training steps."""
    lines = [
        f"| algorithm | seeds | held-out accuracy, start -> end (per seed) | mean at the end | "
        f"samples to reach {bar} (per seed) | seconds of training steps |",
        "|---|---|---|---|---|---|",
    ]
    for algorithm in ALGORITHMS:
        runs = sorted(
            (r for r in rows if r["task"] == task and r["algorithm"] == algorithm),
            key=lambda r: r["seed"],
        )
        if not runs:
            continue
        reach = [
            next((f"{p['samples']:.0f}" for p in r["curve"] if p["accuracy"] >= bar), "-")
            for r in runs
        ]
        lines.append(
            f"| {algorithm} | {len(runs)} | "
            + ", ".join(
                f"{r['curve'][0]['accuracy']:.2f} -> {r['final_accuracy']:.2f}" for r in runs
            )
            + f" | {statistics.fmean(r['final_accuracy'] for r in runs):.2f} | "
            + ", ".join(reach)
            + " | "
            + ", ".join(f"{r['curve'][-1]['train_seconds']:.0f}" for r in runs)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, help="steps of every task (default: the task's)")
    parser.add_argument("--table", action="store_true", help="print the tasks' tables and exit")
    parser.add_argument(
        "--again", action="store_true", help="run the chosen runs again, replacing their rows"
    )
    args = parser.parse_args()
    output = RESULTS / "algorithms.json"
    rows: list[dict[str, Any]] = json.loads(output.read_text())["runs"] if output.exists() else []
    if args.table:
        measured = [t for t in args.tasks if any(r["task"] == t for r in rows)]
        print("\n\n".join(f"`{t}`:\n\n{table(rows, t)}" for t in measured))
        return
    grid = [
        (a, t, s, args.steps or TASKS[t][2])
        for s in args.seeds
        for t in args.tasks
        for a in args.algorithms
    ]
    done = {(r["algorithm"], r["task"], r["seed"], r["steps"]) for r in rows}
    if not args.again:
        grid = [run for run in grid if run not in done]
    print(f"{len(grid)} runs to go ({len(done)} in {output.name} already)", flush=True)
    for n, (algorithm, task, seed, steps) in enumerate(grid, 1):
        row = run_one(algorithm, task, seed, steps)
        same = (algorithm, task, seed, steps)
        rows = [r for r in rows if (r["algorithm"], r["task"], r["seed"], r["steps"]) != same]
        rows.append(row)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps({"what": __doc__.split("\n\n")[0], "runs": rows}, indent=1))
        plot(rows, RESULTS / "algorithms.png")
        start = row["curve"][0]["accuracy"] if row["curve"] else float("nan")
        print(
            f"[{n}/{len(grid)}] {algorithm} on {task}, seed {seed}: held-out accuracy "
            f"{start:.2f} -> {row['final_accuracy']:.2f} in {row['wall_seconds']:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
