"""Run every benchmark in turn (`make bench`); each writes its JSON under benchmarks/results/.

A benchmark whose service is missing (no Docker engine, no vLLM or openreward venv) is skipped
with the command that sets the service up; the rest still run. Exit status 1 if any benchmark
failed.
    python benchmarks/run_all.py [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from engine_bench import vllm_venv

ROOT = Path(__file__).resolve().parents[1]
# where scripts/ci/sdk.sh puts the openreward venv (benchmarks/ors_server.py reads the same)
OPENREWARD_VENV = Path(os.environ.get("ORS_VENVS") or ROOT / ".venvs") / "openreward"
TRL_VENV = Path(
    os.environ.get("PLAIT_TRL_VENV") or ROOT / ".venvs" / "trl"
)  # as benchmarks/vs_trl.py reads it


def docker_engine() -> str | None:
    if (
        shutil.which("docker") is None
        or subprocess.run(["docker", "info"], capture_output=True).returncode
    ):
        return "no Docker engine: bash scripts/ci/docker.sh"
    return None


def venv(path: Path, setup: str) -> Callable[[], str | None]:
    def check() -> str | None:
        return None if (path / "bin" / "python").exists() else f"no {path}: bash {setup}"

    return check


# name -> (script and arguments, what it needs)
BENCHMARKS: dict[str, tuple[list[str], Callable[[], str | None] | None]] = {
    "trainer_throughput": (["trainer_throughput.py"], None),
    "sampling_throughput": (["sampling_throughput.py"], None),
    "tito_tokens": (["tito_tokens.py"], None),
    "prefix_sharing": (["prefix_sharing.py"], None),
    "delta_sync": (["delta_sync.py"], None),
    "async_vs_sync": (["async_vs_sync.py"], None),
    "kl_reference": (["kl_reference.py"], None),
    "engines": (["engines.py"], venv(vllm_venv(), "scripts/ci/vllm.sh")),
    "ors_server": (["ors_server.py"], venv(OPENREWARD_VENV, "scripts/ci/sdk.sh")),
    "docker_sandbox": (["docker_sandbox.py"], docker_engine),
    "proxy_latency": (["proxy_latency.py"], None),
    "routing_replay": (["routing_replay.py"], None),
    "vs_minimal": (["vs_minimal.py"], None),
    "services_overhead": (["services_overhead.py"], None),
    "rollout_scaling": (["rollout_scaling.py"], None),
    "online_rl": (["online_rl.py"], None),
    "vs_trl": (["vs_trl.py", "--steps", "6"], venv(TRL_VENV, "scripts/bench/trl_venv.sh")),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run just these")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args()
    if args.list:
        print("\n".join(BENCHMARKS))
        return 0
    outcomes: dict[str, str] = {}
    for name in args.only or BENCHMARKS:
        script, needs = BENCHMARKS[name]
        missing = needs() if needs else None
        if missing:
            outcomes[name] = f"skipped ({missing})"
            continue
        print(f"== {name}", flush=True)
        started = time.monotonic()
        code = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / script[0]), *script[1:]], cwd=ROOT
        ).returncode
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        outcomes[name] = f"{status} in {time.monotonic() - started:.0f} s"
    print("\n".join(f"{name:22s} {outcome}" for name, outcome in outcomes.items()))
    return int(any(o.startswith("FAILED") for o in outcomes.values()))


if __name__ == "__main__":
    sys.exit(main())
