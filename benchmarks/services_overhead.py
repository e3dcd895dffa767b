"""The controller's step time with every component a service against all in one process.

The same run config (default examples/arith_tiny.toml, evaluation off) runs with its components
in-process, and with its trainer in `plait serve trainer`, its inference engine in
`plait serve inference` (both launched by the run), its environment on an ORS server
(`plait env serve`) and weights going by disk (the trainer service writes each version where
the inference service loads it: `sync.method = "disk"`); nothing else differs. The two
placements alternate `--repeats` times; each run's warm steps (all but the first `--warmup`)
give a median step time (`time/total`) and the median of each part of it (rollout, verify,
train, sync). The ratio is services / in-process of the median run medians (goal 1.2); beside it,
the median ratio of paired steps (step k of a services run against step k of the in-process run
before it: the same work, as both train identically).

    python benchmarks/services_overhead.py [--config examples/arith_tiny.toml] [--steps 12]
        [--repeats 8]

Writes benchmarks/results/services_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
SERVICE_ENGINE = '{engine="torch", engine_options={batch_wait_ms=100}}'
"""The inference service's engine. Its batching window is wider than in-process (50 ms): a step's
requests reach it over HTTP after each episode's ORS set-up, the first often ~80 ms ahead of the
rest (measured), and a batch started on it alone delays the others by a whole (small) batch."""
PARTS = ("time/total", "time/rollout", "time/verify", "time/train", "time/sync")


@contextmanager
def ors_server(env: str, options: list[str], log: Path) -> Iterator[str]:
    from plait_server.engine import free_port

    port = free_port()
    argv = [sys.executable, "-m", "plait.cli", "env", "serve", env, "--port", str(port)]
    for option in options:
        argv += ["-o", option]
    with log.open("wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"the ORS server exited: {log.read_text()[-2000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the ORS server did not start within 120 s")
                time.sleep(0.3)
            yield url
        finally:
            server.terminate()
            server.wait(30)


def run(config: Path, name: str, overrides: list[str], out_dir: Path, steps: int) -> dict[str, Any]:
    args = [sys.executable, "-m", "plait.cli", "run", str(config), "--no-resume"]
    for item in [
        f"run.out_dir={out_dir}",
        f"run.name={name}",
        f"rl.steps={steps}",
        "eval.every=0",
        "run.log_level=warning",
        *overrides,
    ]:
        args += ["-s", item]
    started = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{name} failed: {done.stderr[-3000:]}")
    metrics = [
        json.loads(line) for line in (out_dir / name / "metrics.jsonl").read_text().splitlines()
    ]
    return {
        "process_seconds": time.perf_counter() - started,
        "steps": [m for m in metrics if m["step"] > 0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "arith_tiny.toml")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "services_overhead.json"
    )
    args = parser.parse_args()

    import tomllib

    env = tomllib.loads(args.config.read_text())["env"]
    env_options = [f"{key}={json.dumps(value)}" for key, value in env.get("options", {}).items()]
    placements: dict[str, list[dict[str, Any]]] = {"in_process": [], "services": []}
    with tempfile.TemporaryDirectory(prefix="services-overhead-") as scratch:
        out_dir = Path(scratch)
        with ors_server(env["name"], env_options, out_dir / "ors.log") as ors_url:
            overrides = {
                "in_process": [],
                "services": [
                    "trainer.engine=remote",
                    'trainer.options={engine="torch"}',
                    "inference.engine=remote",
                    f"inference.options={SERVICE_ENGINE}",
                    "env.name=ors",
                    f'env.options={{url="{ors_url}"}}',
                    "sync.method=disk",
                ],
            }
            for repeat in range(args.repeats):
                for placement, extra in overrides.items():
                    result = run(args.config, f"{placement}-{repeat}", extra, out_dir, args.steps)
                    warm = result["steps"][args.warmup :]
                    medians = {
                        part: statistics.median(m[part] for m in warm if part in m)
                        for part in PARTS
                        if any(part in m for m in warm)
                    }
                    placements[placement].append(
                        {
                            "process_seconds": result["process_seconds"],
                            "median": medians,
                            "step_s": [m["time/total"] for m in warm],
                        }
                    )
                    step_parts = ", ".join(
                        f"{k[5:]} {v:.2f}" for k, v in medians.items() if k != "time/total"
                    )
                    print(
                        f"{placement} #{repeat}: median step {medians['time/total']:.2f} s "
                        f"({step_parts})",
                        flush=True,
                    )

    def pooled(placement: str, part: str) -> float:
        return statistics.median(
            r["median"][part] for r in placements[placement] if part in r["median"]
        )

    ratio = pooled("services", "time/total") / pooled("in_process", "time/total")
    # Both placements train identically (same seeds, same tokens: the runs' rewards match step for
    # step), so step k of one run is the same work as step k of the other: the ratios of paired
    # steps, from runs made one after the other, cancel the work's own variation across steps.
    paired = statistics.median(
        s / i
        for a, b in zip(placements["services"], placements["in_process"], strict=True)
        for s, i in zip(a["step_s"], b["step_s"], strict=True)
    )
    result = {
        "benchmark": "services_overhead",
        "config": str(args.config.relative_to(ROOT)),
        "steps": args.steps,
        "warmup_steps": args.warmup,
        "repeats": args.repeats,
        "machine": platform.platform(),
        "runs": placements,
        "median_step_s": {p: {part: pooled(p, part) for part in PARTS} for p in placements},
        "step_time_ratio_services_over_in_process": ratio,
        "median_paired_step_ratio": paired,
        "goal": 1.2,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"step time, services / in-process: {ratio:.2f}x (goal <= 1.2x); median of paired steps "
        f"{paired:.2f}x -> {args.out}"
    )


if __name__ == "__main__":
    main()
