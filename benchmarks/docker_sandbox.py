"""Sandboxed execution: a warm container pool against a fresh container per execution.

Runs the same small program through `plait_docker.Sandbox` in both modes, at concurrency 1 and 8,
side by side in one run on the real Docker engine, and writes executions/s and p50/p99 latency
(each execution's wall time as the caller sees it) to benchmarks/results/docker_sandbox.json.

    python benchmarks/docker_sandbox.py [--scale 0.5]

Needs a running engine and the sandbox image (`bash scripts/ci/docker.sh`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import time
from pathlib import Path

from plait_docker.engine import connect
from plait_docker.sandbox import Sandbox, SandboxOptions

PROGRAM = "import json\nprint(json.dumps(sorted(range(100), key=lambda x: -x)[:3]))\n"
EXPECTED_STDOUT = "[99, 98, 97]\n"
# Executions per (mode, concurrency) at scale 1; a fresh container costs ~10x an exec, so fewer.
EXECUTIONS = {
    ("warm_pool", 1): 100,
    ("warm_pool", 8): 200,
    ("fresh_container", 1): 30,
    ("fresh_container", 8): 48,
}
WARMUP = 2  # per worker, not counted


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low, high = int(rank), min(int(rank) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def measure(mode: str, concurrency: int, executions: int) -> dict:
    options = SandboxOptions(pool_size=concurrency, reuse_containers=mode == "warm_pool")
    started = time.perf_counter()
    sandbox = Sandbox(options)
    setup_s = time.perf_counter() - started

    def timed_execution(_: int) -> float:
        t0 = time.perf_counter()
        result = sandbox.execute(PROGRAM)
        elapsed = time.perf_counter() - t0
        if result.stdout != EXPECTED_STDOUT:
            raise RuntimeError(f"unexpected result in {mode}: {result}")
        return elapsed

    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as workers:
            list(workers.map(timed_execution, range(WARMUP * concurrency)))
            wall_start = time.perf_counter()
            latencies = list(workers.map(timed_execution, range(executions)))
            wall_s = time.perf_counter() - wall_start
    finally:
        sandbox.close()
    return {
        "mode": mode,
        "concurrency": concurrency,
        "executions": executions,
        "wall_s": round(wall_s, 3),
        "executions_per_s": round(executions / wall_s, 3),
        "latency_p50_s": round(statistics.median(latencies), 4),
        "latency_p99_s": round(percentile(latencies, 99), 4),
        "latency_mean_s": round(statistics.fmean(latencies), 4),
        "pool_setup_s": round(setup_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply the number of executions"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "docker_sandbox.json",
    )
    args = parser.parse_args()

    engine = connect().version()
    load_before = os.getloadavg()
    results = []
    for (mode, concurrency), executions in EXECUTIONS.items():
        row = measure(mode, concurrency, max(8, int(executions * args.scale)))
        print(json.dumps(row))
        results.append(row)
    by_key = {(r["mode"], r["concurrency"]): r for r in results}
    ratios = {
        f"concurrency_{c}": {
            "throughput_warm_over_fresh": round(
                by_key["warm_pool", c]["executions_per_s"]
                / by_key["fresh_container", c]["executions_per_s"],
                2,
            ),
            "p50_latency_fresh_over_warm": round(
                by_key["fresh_container", c]["latency_p50_s"]
                / by_key["warm_pool", c]["latency_p50_s"],
                2,
            ),
        }
        for c in (1, 8)
    }
    report = {
        "benchmark": "docker_sandbox",
        "program": PROGRAM,
        "modes": {
            "warm_pool": "pool_size = concurrency containers started up front; "
            "one docker exec per execution",
            "fresh_container": "create + start + one docker exec + remove per execution "
            "(same Sandbox code)",
        },
        "latency": "wall time of one Sandbox.execute call as the caller sees it; "
        "p99 is interpolated over the executions listed "
        "(with few executions it is close to the maximum)",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "docker_engine": engine["Version"],
            "kernel": platform.release(),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
        },
        "results": results,
        "ratios": ratios,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(ratios))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
