"""Where the time of shared LoRA passes goes: the trainer alone, in this process, with no server.

The same runs' forward_backward calls, one pass per run (`LoraRun.forward_backward`) against
one shared pass (`TorchTrainer.forward_backward_adapters`), alternating `--repeats` times in one
process, over `--runs` x `--datums` (datums of 32-128 random tokens, cross-entropy, rank 8).
Each cell reports wall seconds and this process's CPU seconds of both, their ratios, and the
share of the shared pass's time in each kind of operation (torch.profiler, one more pass). With
one torch thread (`--threads 1`, the default) CPU seconds count work alone, unaffected by
whatever else runs on the machine; the ratio of CPU seconds is then the difference in work per
token between the two modes, which bounds what sharing can gain. Writes
benchmarks/results/multi_lora_trainer_MODEL.json.

    python benchmarks/multi_lora_trainer.py [--model smollm2-135m-instruct] [--runs 4 8]
        [--datums 1 4 8] [--repeats 3] [--threads 1]

Needs plait-torch.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from torch.profiler import profile

from plait.api import TRAINER_ENGINE, Datum, LoraConfig, ModelInput, build, resolve_model

RESULTS = Path(__file__).parent / "results"


def run_data(seed: int, datums: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(datums):
        tokens = rng.integers(100, 20000, size=int(rng.integers(32, 129)))
        data.append(
            Datum(
                ModelInput.from_ints(tokens[:-1].tolist()),
                {"target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)},
            )
        )
    return data


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def operation_shares(fn: Callable[[], Any]) -> dict[str, float]:
    """The share of `fn`'s operator time per kind of operation (self time, top ten)."""
    with profile() as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:10]
    return {e.key: e.self_cpu_time_total / total for e in top}


def cell(trainer: Any, runs: int, datums: int, repeats: int) -> dict[str, Any]:
    adapters = [
        trainer.open_adapter(f"r{runs}d{datums}-{i}", LoraConfig(rank=8), seed=i)
        for i in range(runs)
    ]
    batches = [run_data(seed, datums) for seed in range(runs)]
    tokens = sum(d.model_input.length for batch in batches for d in batch)

    def apart() -> None:
        for adapter, batch in zip(adapters, batches, strict=True):
            adapter.forward_backward(batch, "cross_entropy")

    def at_once() -> None:
        trainer.forward_backward_adapters(
            list(zip(adapters, batches, strict=True)), "cross_entropy"
        )

    apart(), at_once()  # warm
    rounds = [(timed(apart), timed(at_once)) for _ in range(repeats)]
    wall_apart, wall_once = (sum(r[i][0] for r in rounds) for i in (0, 1))
    cpu_apart, cpu_once = (sum(r[i][1] for r in rounds) for i in (0, 1))
    result = {
        "runs": runs,
        "datums_per_call": datums,
        "tokens_per_round": tokens,
        "wall_ratio": wall_apart / wall_once,
        "cpu_ratio": cpu_apart / cpu_once,
        "per_repeat_cpu_ratio": [a[1] / o[1] for a, o in rounds],
        "cpu_tokens_per_s_at_once": tokens * repeats / cpu_once,
        "cpu_tokens_per_s_one_after_another": tokens * repeats / cpu_apart,
        "operation_shares_at_once": operation_shares(at_once),
    }
    for adapter in adapters:
        adapter.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--runs", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--datums", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    trainer = build(
        TRAINER_ENGINE,
        "torch",
        resolve_model(args.model),
        options={"threads": args.threads},
        options_path="trainer.options",
        seed=0,
    )
    cells = []
    for runs in args.runs:
        for datums in args.datums:
            cells.append(cell(trainer, runs, datums, args.repeats))
            row = cells[-1]
            matmul = row["operation_shares_at_once"].get("aten::mm", 0.0)
            print(
                f"{runs} runs x {datums} datums: CPU seconds one after another / at once "
                f"{row['cpu_ratio']:.2f}x (wall {row['wall_ratio']:.2f}x); "
                f"{row['cpu_tokens_per_s_at_once']:.0f} tokens per CPU second at once; "
                f"matmul {matmul:.0%} of the shared pass",
                flush=True,
            )
    summary = {
        "what": __doc__.split("\n\n")[0],
        "settings": vars(args) | {"lora_rank": 8, "loss": "cross_entropy", "tokens": [32, 128]},
        "cells": cells,
        "median_cpu_ratio": statistics.median(c["cpu_ratio"] for c in cells),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    output = RESULTS / f"multi_lora_trainer_{args.model}.json"
    output.write_text(json.dumps(summary, indent=1))
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
