"""Routing replay (R3) on against off: how far the trainer's policy is from the sampler's.

Two parts, on the same machine in one run (default config: examples/arith_tiny_moe.toml:
tiny-qwen3-moe-arith, sampled in bfloat16, trained in float32):

1. Paired: the same sampled batches (`--paired-batches` of the run's batch size, routing recorded)
   scored by two float32 trainers at the same weights, one replaying the sampler's experts and one
   routing by itself, at the start weights and again at the weights the R3 run ended with. Same
   tokens, same sampler logprobs: the difference is the replay alone.
2. Training: the run trained twice, `trainer.options.routing_replay` off and on, reporting each
   run's step metrics (its own samples: the runs part after step 1), reward and step time.

Reported: routing agreement with the sampler (the experts the trainer used, and those its own
routers chose), the sampler/trainer mismatch KL (k1 = mean(lp_rollout - lp_train), k2 =
0.5 mean(diff^2)) and the largest importance weight pi_train / pi_rollout over sampled tokens,
and the bytes of routing data per token.

    python benchmarks/routing_replay.py [--config examples/arith_tiny_moe.toml] [--steps 10]

Writes benchmarks/results/routing_replay.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from plait.components import resolve_model
from plait.config import RunConfig, load_config
from plait.logs import configure_logging
from plait.models import ResolvedModel
from plait.plugins import build
from plait.rollout import EpisodeConfig, run_episode
from plait.run.loop import run_training
from plait.types import Datum, SamplingParams
from plait_algorithms.datums import trajectory_to_datums
from plait_torch.options import TorchTrainerOptions
from plait_torch.trainer import TorchTrainer

ROOT = Path(__file__).resolve().parents[1]
REPORTED = (
    "policy/routing_agreement",
    "policy/routing_natural_agreement",
    "policy/mismatch_kl",
    "policy/mismatch_kl_k2",
    "policy/importance_weight_max",
    "data/routing_bytes_per_token",
)


def variant(base: RunConfig, replay: bool, steps: int, out_dir: Path) -> RunConfig:
    return attrs.evolve(
        base,
        run=attrs.evolve(
            base.run,
            name=f"routing-replay-{'on' if replay else 'off'}",
            out_dir=str(out_dir),
            log_level="warning",
        ),
        trainer=attrs.evolve(
            base.trainer, options={**base.trainer.options, "routing_replay": replay}
        ),
        inference=attrs.evolve(
            base.inference, options={**base.inference.options, "enable_return_routed_experts": True}
        ),
        rl=attrs.evolve(base.rl, steps=steps),
        eval=attrs.evolve(base.eval, every=0),
        metrics=attrs.evolve(base.metrics, sinks=["jsonl"], options={}),
    )


def measure(config: RunConfig) -> dict[str, Any]:
    run_training(config, resume=False)
    run_dir = Path(config.run.out_dir) / config.run.name
    steps = [
        m
        for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if m["step"] > 0
    ]
    missing = [key for key in REPORTED if key not in steps[0]]
    if missing:
        raise SystemExit(f"the run reported no {missing}: is the model a mixture of experts?")
    return {
        "step_1": {key: steps[0][key] for key in REPORTED},
        "mean_over_steps": {key: statistics.fmean(m[key] for m in steps) for key in REPORTED},
        "importance_weight_max_over_steps": max(m["policy/importance_weight_max"] for m in steps),
        "reward_by_step": [m["reward/mean"] for m in steps],
        "train_seconds_median": statistics.median(m["time/train"] for m in steps),
    }


async def sample_batches(config: RunConfig, model: ResolvedModel, batches: int) -> list[Datum]:
    """`batches` of the run's batch (groups_per_batch tasks x group_size samples), sampled as the
    run samples them (its inference options: bfloat16, routing recorded), as training data."""
    rl = config.rl
    engine = build(
        "inference_engine",
        config.inference.engine,
        model,
        options=config.inference.options,
        options_path="inference.options",
        seed=config.run.seed,
    )
    renderer = build("renderer", config.renderer.name, model, options=config.renderer.options)
    env = build("env", config.env.name, options=config.env.options)
    episode = EpisodeConfig(
        SamplingParams(max_tokens=rl.max_tokens, temperature=rl.temperature, seed=None)
    )
    tasks = [
        await env.get_task(config.env.train_split, i) for i in range(batches * rl.groups_per_batch)
    ]
    try:
        trajectories = await asyncio.gather(
            *(
                run_episode(env, task, engine, renderer, episode)
                for task in tasks
                for _ in range(rl.group_size)
            )
        )
    finally:
        await engine.close()
    return [d for t in trajectories for d in trajectory_to_datums(t, 0.0)]


def paired(
    model: ResolvedModel, datums: list[Datum], micro_batch: int
) -> dict[str, dict[str, float]]:
    """Both trainers' view of the same datums: agreement, mismatch KL and importance weights."""
    results = {}
    for replay in (False, True):
        trainer = TorchTrainer(model, options=TorchTrainerOptions(routing_replay=replay))
        train_lp, agreed, natural, compared = [], 0.0, 0.0, 0.0
        for start in range(0, len(datums), micro_batch):
            out = trainer.forward(datums[start : start + micro_batch], "importance_sampling")
            train_lp.extend(o["logprobs"].to_numpy() for o in out.loss_fn_outputs)
            agreed += out.metrics["routing_agreed:sum"]
            natural += out.metrics["routing_natural_agreed:sum"]
            compared += out.metrics["routing_compared:sum"]
        trainer.close()
        sampled = [d.loss_fn_inputs["mask"].to_numpy() > 0 for d in datums]
        diff = np.concatenate(
            [
                d.loss_fn_inputs["logprobs"].to_numpy()[m] - lp[m]
                for d, lp, m in zip(datums, train_lp, sampled, strict=True)
            ]
        ).astype(np.float64)
        weights = np.exp(-diff)
        results["replay_on" if replay else "replay_off"] = {
            "routing_agreement": agreed / compared,
            "routing_natural_agreement": natural / compared,
            "mismatch_kl_k1": float(diff.mean()),
            "mismatch_kl_k2": float(0.5 * (diff**2).mean()),
            "mean_abs_logprob_gap": float(np.abs(diff).mean()),
            "importance_weight_max": float(weights.max()),
            "importance_weight_p999": float(np.quantile(weights, 0.999)),
            "sampled_tokens": int(diff.size),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "arith_tiny_moe.toml")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--paired-batches", type=int, default=4)
    parser.add_argument(
        "-s", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "routing_replay.json"
    )
    args = parser.parse_args()
    base = load_config(args.config, args.overrides)
    configure_logging("warning")
    results: dict[str, Any] = {}
    model = resolve_model(base.model.name, tokenizer=base.model.tokenizer, dtype=base.model.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        for replay in (False, True):
            name = "replay_on" if replay else "replay_off"
            results[name] = r = measure(variant(base, replay, args.steps, Path(tmp)))
            first = r["step_1"]
            print(
                f"{name:>10}: step 1 routing agreement {first['policy/routing_agreement']:.4f} "
                f"(own routers {first['policy/routing_natural_agreement']:.4f}), "
                f"mismatch KL {first['policy/mismatch_kl']:.2e}, "
                f"k2 {first['policy/mismatch_kl_k2']:.2e}, "
                f"IS weight max {first['policy/importance_weight_max']:.4f}; "
                f"over {args.steps} steps: "
                f"IS weight max {r['importance_weight_max_over_steps']:.4f}, "
                f"train step {r['train_seconds_median']:.2f} s",
                flush=True,
            )
        trained = (
            Path(tmp) / "routing-replay-on" / "checkpoints" / f"step_{args.steps:06d}" / "trainer"
        )
        end_model = attrs.evolve(
            model, name=f"{model.name} after {args.steps} R3 steps", path=trained
        )
        for label, weights in (("start", model), ("end", end_model)):
            datums = asyncio.run(sample_batches(base, weights, args.paired_batches))
            results[f"paired_{label}"] = pair = paired(weights, datums, base.rl.micro_batch_size)
            for name, r in pair.items():
                print(
                    f"paired at the {label} weights, {name:>10}: "
                    f"routing agreement {r['routing_agreement']:.4f} "
                    f"(own routers {r['routing_natural_agreement']:.4f}), "
                    f"k1 {r['mismatch_kl_k1']:.2e}, k2 {r['mismatch_kl_k2']:.2e}, "
                    f"mean |gap| {r['mean_abs_logprob_gap']:.2e}, "
                    f"IS weight max {r['importance_weight_max']:.4f} "
                    f"(p99.9 {r['importance_weight_p999']:.4f}) over "
                    f"{r['sampled_tokens']} tokens",
                    flush=True,
                )
    ratios = {
        f"{label}_{key}_on_over_off": results[f"paired_{label}"]["replay_on"][key]
        / results[f"paired_{label}"]["replay_off"][key]
        for label in ("start", "end")
        for key in ("mismatch_kl_k2", "mean_abs_logprob_gap")
    }
    ratios.update(
        {
            f"{label}_importance_weight_max_excess_on_over_off": (
                results[f"paired_{label}"]["replay_on"]["importance_weight_max"] - 1
            )
            / (results[f"paired_{label}"]["replay_off"]["importance_weight_max"] - 1)
            for label in ("start", "end")
        }
    )
    ratios["train_seconds_on_over_off"] = (
        results["replay_on"]["train_seconds_median"] / results["replay_off"]["train_seconds_median"]
    )
    print(", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "routing_replay",
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "config": str(
                    args.config.relative_to(ROOT)
                    if args.config.is_relative_to(ROOT)
                    else args.config
                ),
                "overrides": args.overrides,
                "model": base.model.name,
                "steps": args.steps,
                "sampler_dtype": base.inference.options.get("dtype"),
                "trainer_dtype": base.model.dtype,
                "paired_batches": args.paired_batches,
                "ratios": ratios,
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
