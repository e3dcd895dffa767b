"""One GRPO step, plait against TRL's GRPOTrainer: step time and reward on the same workload, in
one run.

The workload is benchmarks/grpo_workload.py's: SmolLM2-135M-Instruct in float32 on the CPU,
`math.arith` preset `sums`, 8 prompts x 8 samples per step, 8 new tokens, temperature 1 (top-p 1,
top-k off), GRPO advantages, no KL term, AdamW at 2e-5 (beta2 0.95, no weight decay, constant
rate), gradient clipping at 1, the strict exact-match reward. Both sides run as subprocesses, one
after the other (--order):

- TRL: benchmarks/trl_grpo.py in the TRL venv (`bash scripts/bench/trl_venv.sh` builds .venvs/trl,
  or $PLAIT_TRL_VENV): GRPOTrainer, transformers' `generate` (use_vllm=False), use_cpu, bf16 off,
  beta=0, loss_type "dapo", scale_rewards "group", num_iterations 1, one 8x8 generation batch per
  optimizer step. The step time is on_step_begin -> on_step_end of a TrainerCallback: generation,
  rewards, forward/backward, clipping and the AdamW step.
- plait: `plait run` on grpo_workload.plait_config (engine "torch" for sampling and training, loss
  "importance_sampling"); the step time is the run's `time/total` (rollout, prepare, train, weight
  sync), which leaves out the evaluations before and after training.

Reported: the median step time of each side over the steps after the first --warmup (default 1,
dropped as warm-up: first-call allocations, lazy inits), the ratio TRL / plait of those medians,
the rollout/train split of each (TRL: generate + rewards + advantages, then the rest of the step;
plait: time/rollout, time/train), each process's wall and CPU time and peak memory, and the mean
reward per step (over all steps, the timed ones, and the first and last 3). Both sides get the same
torch thread count: torch's default, or --threads passed to both (OMP_NUM_THREADS and each side's
own setting).

Differences that remain (recorded in the JSON too):

- Compute per step, the bulk of the gap. Every prompt is ~87 tokens (system prompt and three worked
  examples, the same in every task) and a reply ~3. plait-torch prefills each distinct prompt once
  (after their common prefix) and repeats its KV cache for the 8 samples, trains with prefix sharing
  (the shared positions computed once, forward and backward) and drops groups whose 8 rewards are
  equal (zero advantage; rl.remove_constant_reward_groups). TRL's `generate` prefills the prompt
  for each of the 64 rows and its forward/backward runs over all 64 full sequences (~5,800 tokens).
  These are what each framework does on this step, so they are in the timing; the per-side
  rollout/train split shows where the time goes.
- Micro-batches: TRL runs the 64 completions through forward/backward in --trl-micro-batch chunks
  (default 16, gradient accumulation 4: 64 at once went past 16 GB and was OOM-killed here); the
  "dapo" loss divides by the tokens of the whole step, so the update is the same as with one batch.
  plait chunks by tokens (micro_batch_tokens 2048).
- Old logprobs: neither side runs an extra forward pass for them. TRL (generation aligned with the
  optimizer step) uses the detached current logprobs, so its ratio is exactly 1; plait uses the
  sampler's logprobs (same float32 weights, so the ratio is 1 up to numerics).
- Advantages: TRL divides by the unbiased group std + 1e-4, plait by the population std + 1e-6;
  TRL's token-mean also counts the tokens of the constant groups plait dropped, so its
  effective step is smaller on batches with such groups.
- Noise: on a 2-core machine a busy neighbour slows either side by several times (TRL's identical
  generation step took 8 s to 50 s beside another job), so the fastest step of each is reported
  too; rerun with --order plait-first to see the order's effect.
- Tasks: the same distribution (grpo_workload.write_tasks for TRL, the env itself for plait), but
  each side draws its own prompts and samples with its own RNG: rewards are comparable as curves,
  not step by step.

    python benchmarks/vs_trl.py [--steps 10] [--threads N] [--order plait-first]

Writes benchmarks/results/vs_trl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import engine_bench as common
import grpo_workload as workload

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def trl_venv() -> Path:
    """The venv scripts/bench/trl_venv.sh builds: $PLAIT_TRL_VENV, else .venvs/trl in the
    repository."""
    return Path(os.environ.get("PLAIT_TRL_VENV") or ROOT / ".venvs" / "trl")


def run_child(cmd: list[str], log: Path, threads: int | None) -> dict[str, float]:
    """Run `cmd` with its output in `log`; its wall time and peak resident memory (own rusage)."""
    env = {**os.environ, **OFFLINE}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise SystemExit(f"{' '.join(cmd[:3])} ... exited {proc.returncode}:\n{tail}")
    return {
        "process_seconds": wall,
        "process_cpu_seconds": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
    }


def run_trl(args: argparse.Namespace, tmp: Path, tasks: Path, model: Path) -> dict[str, Any]:
    out = tmp / "trl.json"
    cmd = [
        str(trl_venv() / "bin" / "python"),
        str(HERE / "trl_grpo.py"),
        "--model",
        str(model),
        "--tasks",
        str(tasks),
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--groups",
        str(workload.GROUPS),
        "--group-size",
        str(workload.GROUP_SIZE),
        "--max-tokens",
        str(workload.MAX_TOKENS),
        "--temperature",
        str(workload.TEMPERATURE),
        "--learning-rate",
        str(workload.LEARNING_RATE),
        "--grad-clip",
        str(workload.GRAD_CLIP),
        "--seed",
        str(workload.SEED),
        "--micro-batch",
        str(args.trl_micro_batch),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    process = run_child(cmd, tmp / "trl.log", args.threads)
    result = json.loads(out.read_text())
    steps, rollout = result["step_seconds"], result["rollout_seconds"]
    return {
        **result,
        **process,
        "train_seconds": [s - r for s, r in zip(steps, rollout, strict=True)],
        "frac_reward_zero_std_by_step": [log.get("frac_reward_zero_std") for log in result["logs"]],
        "completion_length_by_step": [log.get("completions/mean_length") for log in result["logs"]],
    }


def run_plait(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    name = "vs-trl-plait"
    config = tmp / "plait.toml"
    config.write_text(workload.plait_config(tmp / "runs", name, args.steps))
    process = run_child(
        workload.plait_command(config, args.threads), tmp / "plait.log", args.threads
    )
    steps = workload.plait_steps(tmp / "runs" / name, args.steps)
    return {
        **process,
        "time_keys": sorted(k for k in steps[0] if k.startswith("time/")),
        "step_seconds": [r["time/total"] for r in steps],
        "rollout_seconds": [r["time/rollout"] for r in steps],
        "train_seconds": [r["time/train"] for r in steps],
        "reward_by_step": [r["reward/mean"] for r in steps],
        "groups_constant_by_step": [r.get("data/groups_constant") for r in steps],
        "action_tokens_by_step": [r.get("data/action_tokens") for r in steps],
    }


def summarize(side: dict[str, Any], warmup: int) -> dict[str, Any]:
    timed = slice(warmup, None)
    rewards = side["reward_by_step"]
    return {
        "median_step_seconds": common.median(side["step_seconds"][timed]),
        "median_rollout_seconds": common.median(side["rollout_seconds"][timed]),
        "median_train_seconds": common.median(side["train_seconds"][timed]),
        "mean_step_seconds": statistics.fmean(side["step_seconds"][timed]),
        "min_step_seconds": min(
            side["step_seconds"][timed]
        ),  # the least disturbed by a busy neighbour
        "reward_mean": statistics.fmean(rewards),
        "reward_mean_timed_steps": statistics.fmean(rewards[timed]),
        "reward_first_3": statistics.fmean(rewards[:3]),
        "reward_last_3": statistics.fmean(rewards[-3:]),
        "peak_rss_mb": side["peak_rss_mb"],
        "process_seconds": side["process_seconds"],
        "process_cpu_seconds": side["process_cpu_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="GRPO steps on each side")
    parser.add_argument(
        "--warmup", type=int, default=1, help="first steps left out of the step-time medians"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads on both sides (default: torch's)"
    )
    parser.add_argument("--order", choices=("trl-first", "plait-first"), default="trl-first")
    parser.add_argument(
        "--trl-micro-batch",
        type=int,
        default=16,
        help="TRL's completions per forward/backward (64 = no gradient accumulation)",
    )
    parser.add_argument("--out", type=Path, default=common.RESULTS / "vs_trl.json")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must be more than --warmup")
    python = trl_venv() / "bin" / "python"
    if not python.exists():
        raise SystemExit(
            f"no TRL venv at {trl_venv()}: build it with `bash scripts/bench/trl_venv.sh`"
        )
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    model = workload.model_dir()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="plait-vs-trl-") as name:
        tmp = Path(name)
        tasks = workload.write_tasks(tmp / "tasks.jsonl", args.steps * workload.GROUPS)
        order = ("trl", "plait") if args.order == "trl-first" else ("plait", "trl")
        for side in order:
            print(f"vs_trl: running {side} ({args.steps} steps)", flush=True)
            results[side] = (
                run_trl(args, tmp, tasks, model) if side == "trl" else run_plait(args, tmp)
            )

    summary = {side: summarize(results[side], args.warmup) for side in ("plait", "trl")}
    ratio = summary["trl"]["median_step_seconds"] / summary["plait"]["median_step_seconds"]
    print(
        f"\n{args.steps} steps each ({args.order}); "
        f"step-time medians leave out the first {args.warmup} step(s) as warm-up; "
        "rewards are means of the per-step mean reward"
    )
    print(
        f"{'side':<6} {'step s':>8} {'rollout s':>10} {'train s':>8} {'reward':>7} {'first 3':>8} "
        f"{'last 3':>7} {'peak MB':>8} {'proc s':>7} {'proc cpu s':>10}"
    )
    for side in ("plait", "trl"):
        s = summary[side]
        print(
            f"{side:<6} {s['median_step_seconds']:>8.2f} {s['median_rollout_seconds']:>10.2f} "
            f"{s['median_train_seconds']:>8.2f} {s['reward_mean']:>7.3f} "
            f"{s['reward_first_3']:>8.3f} {s['reward_last_3']:>7.3f} {s['peak_rss_mb']:>8.0f} "
            f"{s['process_seconds']:>7.0f} {s['process_cpu_seconds']:>10.0f}"
        )
    fastest = summary["trl"]["min_step_seconds"] / summary["plait"]["min_step_seconds"]
    print(f"TRL / plait median step time: {ratio:.2f}x (fastest steps: {fastest:.2f}x)")

    trl = results["trl"]
    result = {
        "machine": common.machine(),
        "trl_side": {
            "versions": trl["versions"],
            "torch_threads": trl["torch_threads"],
            "model_dtype": trl["model_dtype"],
            "device": trl["device"],
            "activation_checkpointing": trl["activation_checkpointing"],
            "generation_config": trl["generation_config"],
            "batch": trl["batch"],
        },
        "settings": {
            "model": workload.MODEL,
            "env": "math.arith",
            "env_options": workload.ENV_OPTIONS,
            "groups": workload.GROUPS,
            "group_size": workload.GROUP_SIZE,
            "max_tokens": workload.MAX_TOKENS,
            "temperature": workload.TEMPERATURE,
            "top_p": 1.0,
            "top_k": "off",
            "learning_rate": workload.LEARNING_RATE,
            "grad_clip": workload.GRAD_CLIP,
            "seed": workload.SEED,
            "steps": args.steps,
            "warmup_steps_dropped": args.warmup,
            "threads": args.threads,
            "order": args.order,
            "trl_micro_batch": args.trl_micro_batch,
            "plait_step_time": "metrics.jsonl time/total "
            "(rollout + prepare + train + sync; no eval)",
            "trl_step_time": "TrainerCallback on_step_begin -> on_step_end (generation + rewards + "
            "forward/backward + clip + AdamW)",
        },
        "summary": summary,
        "ratio_trl_over_plait": {
            "median_step_seconds": ratio,
            "min_step_seconds": summary["trl"]["min_step_seconds"]
            / summary["plait"]["min_step_seconds"],
            "median_rollout_seconds": summary["trl"]["median_rollout_seconds"]
            / summary["plait"]["median_rollout_seconds"],
            "median_train_seconds": summary["trl"]["median_train_seconds"]
            / summary["plait"]["median_train_seconds"],
        },
        "per_step": {
            side: {k: v for k, v in results[side].items() if isinstance(v, list) and k != "logs"}
            for side in ("plait", "trl")
        },
        "plait_time_keys": results["plait"]["time_keys"],
        "trl_logs": trl["logs"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
