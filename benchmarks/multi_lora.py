"""LoRA training runs on one `plait serve tinker` server: all at once against the same runs one
after another, driven by the real tinker SDK (one ServiceClient per run, as many users would,
each in a process of its own), over a matrix of run counts and datums per call.

Each run trains its own adapter (rank 8) on its own supervised data (datums of random tokens,
`--tokens` long) for `--steps` steps (forward_backward, then optim_step). At once, the server
puts the runs' forward_backward calls into shared passes
(`AdapterTrainer.forward_backward_adapters`); one after another, each pass holds one run. For
every cell (runs x datums per call) the two modes alternate, `--repeats` times each, in one
process, with every run's client process started (and its run created) before the clock starts,
and every repeat starting from the same saved state, so that the only difference is the order of
the calls. A cell reports the total throughput (trained tokens per second) of each mode, their
ratio (at once / one after another, from the summed seconds of every repeat), each repeat's
ratio, the shared passes, how long the trainer's thread was busy (passes, optim steps), the CPU
seconds of the server's process, how far each run's loss curve at once is from the same run
alone, and the load average around it (other work on the machine slows both modes, which the
alternation spreads evenly). Writes benchmarks/results/multi_lora_MODEL.json
(multi_lora_MODEL_tokensMIN-MAX.json for other `--tokens`).

    python benchmarks/multi_lora.py [--model smollm2-135m-instruct] [--runs 4 8]
        [--datums 1 4 8] [--tokens 32 128] [--steps 2] [--repeats 3]

Needs plait-torch, plait-tinker and tinker==0.38.0.
"""

from __future__ import annotations

import os

# Before torch loads: OpenMP threads that wait for each other spin 10,000 times, not libgomp's
# default 300,000, before they sleep. The two cores are shared with the server's event loop, every
# client process here, and whatever else runs on the machine; a thread that spins holds a core
# that the thread it waits for needs, and with the default a pass took 5-20 times as long
# whenever anything else ran (measured; `GOMP_SPINCOUNT=300000` to see it). Sleeping at once
# (OMP_WAIT_POLICY=PASSIVE) is steady but about 1.5 times slower on an idle machine.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import argparse
import asyncio
import json
import multiprocessing
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
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
DEFAULT_TOKENS = [32, 128]


def serve(storage: Path, model: str) -> tuple[str, TinkerApp, Callable[[], None]]:
    """The server in a thread of this process: its URL, the app, and a function that stops it."""
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

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    started.wait(120)

    def shutdown() -> None:  # before the storage goes, so that no request meets a missing run
        shutdown()
        thread.join(60)

    return url[0], app, shutdown


def run_data(seed: int, datums: int, lengths: tuple[int, int]) -> list[tinker.types.Datum]:
    """`datums` datums of random tokens, each between lengths[0] and lengths[1] tokens long."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(datums):
        tokens = rng.integers(
            100, 20000, size=int(rng.integers(lengths[0], lengths[1] + 1))
        ).tolist()
        data.append(
            tinker.types.Datum(
                model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tinker.types.TensorData.from_numpy(np.array(tokens[1:])),
                    "weights": tinker.types.TensorData.from_numpy(
                        np.ones(len(tokens) - 1, dtype=np.float32)
                    ),
                },
            )
        )
    return data


def trained_tokens(seed: int, datums: int, lengths: tuple[int, int]) -> int:
    return sum(d.model_input.length for d in run_data(seed, datums, lengths))


def client(
    url: str,
    seed: int,
    steps: int,
    datums: int,
    lengths: tuple[int, int],
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    """One user's training program, in a process of its own: creates its run and says so through
    `ready`; on each `go` restores the run's first state and says so, and on the next `go` trains
    `steps` steps and returns (seed, losses, start and end time of its training, its CPU
    seconds) through `results`; None on `go` ends it."""
    data = run_data(seed, datums, lengths)
    with tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
        run = service.create_lora_training_client(base_model=BASE, rank=8, seed=seed).result()
        # The same start for every repeat, so that the modes' loss curves can be compared.
        start = run.save_state("start").result().path
        ready.put(seed)
        while go.get():
            run.load_state_with_optimizer(start).result()
            ready.put(seed)
            go.get()  # every run of the group restored (one after another, on the trainer)
            began, cpu, losses = time.time(), time.process_time(), []
            for _ in range(steps):
                result = run.forward_backward(data, "cross_entropy")
                run.optim_step(tinker.types.AdamParams(learning_rate=1e-3)).result()
                losses.append(result.result().metrics["loss:sum"])
            results.put((seed, losses, began, time.time(), time.process_time() - cpu))


class Clients:
    """One client process per run, its run created, waiting for the word to train."""

    def __init__(
        self, url: str, runs: int, steps: int, datums: int, lengths: tuple[int, int]
    ) -> None:
        context = multiprocessing.get_context("spawn")
        self.ready, self.results = context.Queue(), context.Queue()
        self.go = [context.Queue() for _ in range(runs)]
        self.processes = [
            context.Process(
                target=client,
                args=(url, seed, steps, datums, lengths, self.ready, self.go[seed], self.results),
                daemon=True,
            )
            for seed in range(runs)
        ]
        for process in self.processes:
            process.start()
        for _ in range(runs):
            self.ready.get(timeout=600)

    def train(self, group: list[int]) -> list[tuple[Any, ...]]:
        for seed in group:  # restore
            self.go[seed].put(True)
        for _ in group:
            self.ready.get(timeout=600)
        for seed in group:  # and train
            self.go[seed].put(True)
        return [self.results.get(timeout=3600) for _ in group]

    def close(self) -> None:
        for go in self.go:
            go.put(None)
        for process in self.processes:
            process.join(60)


class TrainerClock:
    """Seconds the trainer's thread spends on the batcher's work: forward_backward passes and
    optim_step calls (the rest of a mode's time the trainer waits for requests)."""

    def __init__(self, batcher: Any) -> None:
        self.passes = self.steps = 0.0
        inner = batcher._train

        async def timed(fn: Any, *args: Any) -> Any:
            began = time.perf_counter()
            try:
                return await inner(fn, *args)
            finally:
                spent = time.perf_counter() - began
                if getattr(fn, "__name__", "") == "step_each":
                    self.steps += spent
                else:
                    self.passes += spent

        batcher._train = timed


def measure(clients: Clients, clock: TrainerClock, runs: int, together: bool) -> dict[str, Any]:
    groups = [list(range(runs))] if together else [[seed] for seed in range(runs)]
    cpu = time.process_time()  # this process's: the server's event loop and trainer threads
    passes, steps = clock.passes, clock.steps
    finished = [clients.train(group) for group in groups]
    server_cpu = time.process_time() - cpu
    seconds = sum(
        max(item[3] for item in done) - min(item[2] for item in done) for done in finished
    )
    return {
        "seconds": seconds,
        "curves": [item[1] for item in sorted(item for done in finished for item in done)],
        "client_cpu_seconds": sum(item[4] for done in finished for item in done),
        "server_cpu_seconds": server_cpu,
        "trainer_pass_seconds": clock.passes - passes,
        "trainer_optim_step_seconds": clock.steps - steps,
    }


def cell(
    url: str,
    app: TinkerApp,
    clock: TrainerClock,
    args: argparse.Namespace,
    runs: int,
    datums: int,
) -> dict[str, Any]:
    lengths = (args.tokens[0], args.tokens[1])
    tokens = args.steps * sum(trained_tokens(seed, datums, lengths) for seed in range(runs))
    load_before = os.getloadavg()
    clients = Clients(url, runs, args.steps, datums, lengths)
    batcher = app.service.batchers[BASE]
    rounds = []
    try:
        for _ in range(args.repeats):
            for together in (False, True):
                passes, calls = batcher.passes, batcher.calls
                result = measure(clients, clock, runs, together)
                result.update(
                    mode="at once" if together else "one after another",
                    tokens_per_s=tokens / result["seconds"],
                    passes=batcher.passes - passes,
                    calls=batcher.calls - calls,
                    load_average_1min=os.getloadavg()[0],
                )
                print(
                    f"{runs} runs x {datums} datums {result['mode']:>18}: "
                    f"{result['seconds']:6.1f} s {result['tokens_per_s']:6.0f} tokens/s, "
                    f"{result['calls']} calls in {result['passes']} passes; trainer busy "
                    f"{result['trainer_pass_seconds']:.1f} + "
                    f"{result['trainer_optim_step_seconds']:.1f} s; CPU s: server "
                    f"{result['server_cpu_seconds']:.1f}, clients "
                    f"{result['client_cpu_seconds']:.1f}; load {result['load_average_1min']:.1f}",
                    flush=True,
                )
                rounds.append(result)
    finally:
        clients.close()
    serial = [r for r in rounds if r["mode"] == "one after another"]
    concurrent = [r for r in rounds if r["mode"] == "at once"]
    gaps = [
        abs(a - b) / abs(b)
        for c, s in zip(concurrent, serial, strict=True)
        for run_c, run_s in zip(c["curves"], s["curves"], strict=True)
        for a, b in zip(run_c, run_s, strict=True)
    ]
    serial_s, concurrent_s = (sum(r["seconds"] for r in rs) for rs in (serial, concurrent))
    return {
        "runs": runs,
        "datums_per_call": datums,
        "ratio": serial_s / concurrent_s,
        "per_repeat_ratio": [
            s["seconds"] / c["seconds"] for s, c in zip(serial, concurrent, strict=True)
        ],
        "server_cpu_ratio": sum(r["server_cpu_seconds"] for r in serial)
        / sum(r["server_cpu_seconds"] for r in concurrent),
        "tokens_per_s_at_once": tokens * len(concurrent) / concurrent_s,
        "tokens_per_s_one_after_another": tokens * len(serial) / serial_s,
        "trainer_busy_fraction": {
            mode: sum(r["trainer_pass_seconds"] + r["trainer_optim_step_seconds"] for r in rs)
            / sum(r["seconds"] for r in rs)
            for mode, rs in (("at_once", concurrent), ("one_after_another", serial))
        },
        "trained_tokens_per_repeat": tokens,
        "repeats": args.repeats,
        "steps": args.steps,
        "runs_per_pass_at_once": statistics.fmean(r["calls"] / r["passes"] for r in concurrent),
        "loss_curves_max_relative_gap": max(gaps),
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "rounds": [{k: v for k, v in r.items() if k != "curves"} for r in rounds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="smollm2-135m-instruct", help="a plait model name (plait models)"
    )
    parser.add_argument("--runs", type=int, nargs="+", default=[4, 8])
    parser.add_argument(
        "--datums", type=int, nargs="+", default=[1, 4, 8], help="datums per forward_backward call"
    )
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tokens",
        type=int,
        nargs=2,
        default=DEFAULT_TOKENS,
        metavar=("MIN", "MAX"),
        help="tokens per datum",
    )
    parser.add_argument("--output", type=Path, help="the JSON to write (default: see above)")
    args = parser.parse_args()
    began = time.time()
    with tempfile.TemporaryDirectory() as storage:
        url, app, shutdown = serve(Path(storage), args.model)
        warm = Clients(url, 1, 1, 1, (args.tokens[0], args.tokens[1]))  # the base model loads
        warm.train([0])
        warm.close()
        clock = TrainerClock(app.service.batchers[BASE])
        cells = [
            cell(url, app, clock, args, runs, datums)
            for runs in args.runs
            for datums in args.datums
        ]
        shutdown()
    summary = {
        "what": __doc__.split("\n\n")[0],
        "settings": vars(args)
        | {
            "lora_rank": 8,
            "loss": "cross_entropy",
            "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        },
        "cells": cells,
        "wall_seconds": time.time() - began,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
        },
    }
    suffix = "" if args.tokens == DEFAULT_TOKENS else f"_tokens{args.tokens[0]}-{args.tokens[1]}"
    output = args.output or RESULTS / f"multi_lora_{args.model}{suffix}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=1, default=str))
    print("runs  datums  at once / one after another  tokens/s at once, apart  loss gap  load")
    for row in cells:
        print(
            f"{row['runs']:>4}  {row['datums_per_call']:>6}  {row['ratio']:>26.2f}x  "
            f"{row['tokens_per_s_at_once']:>15.0f}, {row['tokens_per_s_one_after_another']:<6.0f}"
            f"  {row['loss_curves_max_relative_gap']:8.1e}  {row['load_average_after'][1]:.1f}"
        )


if __name__ == "__main__":
    main()
