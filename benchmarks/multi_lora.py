"""Eight LoRA training runs on one `plait serve tinker` server: all at once against the same eight
one after another, driven by the real tinker SDK (one ServiceClient per run, as eight users
would, each in a process of its own). Each run trains its own adapter (rank 8) on its own
supervised data for a few steps (forward_backward, then optim_step). At once, the server puts the
runs' forward_backward calls into shared passes (`AdapterTrainer.forward_backward_adapters`); one
after another, each pass holds one run. The two modes alternate, `--repeats` times each, in one
process; the report gives total throughput (trained tokens per second) of each, their ratio, and
how far each run's loss curve at once is from the same run alone. Writes
benchmarks/results/multi_lora_MODEL.json (multi_lora_MODEL_tokensMIN-MAX.json with --tokens).

    python benchmarks/multi_lora.py [--model tiny-qwen3] [--runs 8] [--steps 5] [--batch 1 8]
        [--repeats 2]

Needs plait-torch, plait-tinker and tinker==0.38.0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import tinker

from plait.schema import structure
from plait_tinker.app import TinkerApp, build_app
from plait_tinker.config import TinkerServerConfig

RESULTS = Path(__file__).parent / "results"
BASE = "base"  # the name clients use for the served model
API_KEY = "tml-bench"


def serve(storage: Path, model: str) -> tuple[str, TinkerApp, threading.Event]:
    config = structure(
        TinkerServerConfig,
        {
            "models": {BASE: {"model": model}},
            "tenants": [{"name": "bench", "api_key": API_KEY, "max_training_runs": 64}],
        },
    )
    app = build_app(config, storage)
    started, stop, url = threading.Event(), threading.Event(), []

    async def main() -> None:
        async with app.serving("127.0.0.1", 0) as bound:
            url.append(bound)
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.1)

    threading.Thread(target=lambda: asyncio.run(main()), daemon=True).start()
    started.wait(120)
    return url[0], app, stop


def run_data(seed: int, batch: int, lengths: tuple[int, int]) -> list[tinker.types.Datum]:
    """`batch` datums of random tokens, each between lengths[0] and lengths[1] tokens long."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(batch):
        tokens = rng.integers(
            100, 20000, size=int(rng.integers(lengths[0], lengths[1] + 1))
        ).tolist()
        data.append(
            tinker.types.Datum(
                model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
            )
        )
    return data


def client(
    url: str, seed: int, steps: int, batch: int, lengths: tuple[int, int], start: Any, results: Any
) -> None:
    """One user's training program, in a process of its own: returns (seed, losses, start and end
    time of its training) through `results`; creating the run happens before `start`."""
    data = run_data(seed, batch, lengths)
    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
        run = service.create_lora_training_client(base_model=BASE, rank=8, seed=seed).result()
        start.wait()
        began, cpu, losses = time.time(), time.process_time(), []
        for _ in range(steps):
            result = run.forward_backward(data, "cross_entropy")
            run.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result()
            losses.append(result.result().metrics["loss:sum"])
        results.put((seed, losses, began, time.time(), time.process_time() - cpu))


def measure(
    url: str, runs: int, steps: int, batch: int, lengths: tuple[int, int], together: bool
) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    groups = [list(range(runs))] if together else [[seed] for seed in range(runs)]
    finished = []
    for group in groups:
        start = context.Barrier(len(group))
        processes = [
            context.Process(target=client, args=(url, seed, steps, batch, lengths, start, results))
            for seed in group
        ]
        for process in processes:
            process.start()
        finished.append([results.get(timeout=1800) for _ in group])
        for process in processes:
            process.join()
    seconds = sum(
        max(item[3] for item in done) - min(item[2] for item in done) for done in finished
    )
    curves = [item[1] for item in sorted(item for done in finished for item in done)]
    tokens = (
        runs * steps * sum(len(d.model_input.to_ints()) for d in run_data(0, batch, lengths))
    )  # about: run 0's size
    client_cpu = sum(item[4] for done in finished for item in done)
    return {
        "seconds": seconds,
        "curves": curves,
        "tokens_per_s": tokens / seconds,
        "client_cpu_seconds": client_cpu,
    }


def compare(url: str, app: TinkerApp, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    rounds = []
    for _ in range(args.repeats):
        for together in (False, True):
            batcher = app.service.batchers[BASE]
            passes, calls = batcher.passes, batcher.calls
            result = measure(url, args.runs, args.steps, batch, tuple(args.tokens), together)
            result.update(
                mode="at once" if together else "one after another",
                passes=batcher.passes - passes,
                calls=batcher.calls - calls,
            )
            print(
                f"batch {batch:>2} {result['mode']:>18}: {result['seconds']:6.1f} s  "
                f"{result['tokens_per_s']:7.0f} tokens/s  "
                f"{result['calls']} forward_backward calls in {result['passes']} passes; "
                f"the clients used {result['client_cpu_seconds']:.1f} CPU s",
                flush=True,
            )
            rounds.append(result)
    serial = [r for r in rounds if r["mode"] == "one after another"]
    concurrent = [r for r in rounds if r["mode"] == "at once"]
    gaps = [
        abs(a - b) / abs(b)
        for c, s in zip(concurrent, serial, strict=True)
        for run_c, run_s in zip(c["curves"], s["curves"], strict=True)
        for a, b in zip(run_c, run_s, strict=True)
    ]
    return {
        "datums_per_call": batch,
        "throughput_ratio_at_once_vs_one_after_another": sum(r["seconds"] for r in serial)
        / sum(r["seconds"] for r in concurrent),
        "per_repeat_ratio": [
            s["seconds"] / c["seconds"] for s, c in zip(serial, concurrent, strict=True)
        ],
        "seconds": {
            "one_after_another": [r["seconds"] for r in serial],
            "at_once": [r["seconds"] for r in concurrent],
        },
        "runs_per_pass_at_once": statistics.fmean(r["calls"] / r["passes"] for r in concurrent),
        "loss_curves_max_relative_gap": max(gaps),
        "rounds": [{k: v for k, v in r.items() if k != "curves"} for r in rounds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen3", help="a plait model name (plait models)")
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[1, 8], help="datums per forward_backward call"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--tokens",
        type=int,
        nargs=2,
        default=[32, 63],
        metavar=("MIN", "MAX"),
        help="tokens per datum (short ones leave more of a pass to share)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as storage:
        url, app, stop = serve(Path(storage), args.model)
        measure(url, 1, 1, 1, tuple(args.tokens), together=False)  # warm-up: the base model loads
        by_batch = [compare(url, app, args, batch) for batch in args.batch]
        stop.set()
    summary = {
        "what": __doc__.split("\n\n")[0],
        "settings": vars(args) | {"lora_rank": 8, "loss": "cross_entropy"},
        "by_datums_per_call": by_batch,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
        },
    }
    suffix = "" if args.tokens == [32, 63] else f"_tokens{args.tokens[0]}-{args.tokens[1]}"
    (RESULTS / f"multi_lora_{args.model}{suffix}.json").write_text(json.dumps(summary, indent=1))
    for result in by_batch:
        print(
            f"{result['datums_per_call']} datums per call: at once / one after another "
            f"{result['throughput_ratio_at_once_vs_one_after_another']:.2f}x throughput, "
            f"{result['runs_per_pass_at_once']:.1f} runs per pass; loss curves differ by at most "
            f"{result['loss_curves_max_relative_gap']:.1e} (relative)"
        )


if __name__ == "__main__":
    main()
