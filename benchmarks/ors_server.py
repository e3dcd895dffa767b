"""ORS server throughput and tool-call latency: plait's server vs openreward's, side by side.

Both servers run the same environment (sdk/tests/interop/arith_env.py, written for `ors`; only its
import line differs) as separate processes on loopback. One client (plait's ORS client) plays
episodes against each: create a session, read the prompt, call three tools (hint, note, answer),
delete it. Measured at 1 and 64 concurrent sessions: episodes/s and the p50/p99 latency of a tool
call (a whole /call SSE round trip, seen by the client). Writes benchmarks/results/ors_server.json.

    python benchmarks/ors_server.py [--episodes-per-session 5] [--sequential-episodes 100]

Needs the openreward venv from scripts/ci/sdk.sh ($ORS_VENVS/openreward).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from plait_sdk.client import ORSEnvironment, ORSOptions

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "sdk" / "tests" / "interop" / "serve_arith_env.py"
VENVS = Path(os.environ.get("ORS_VENVS", Path(__file__).resolve().parents[1] / ".venvs"))
ANSWERS = {"t0": "42", "t1": "72", "t2": "63", "t3": "12"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(python: str, sdk: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "OPENREWARD_DISABLE_UPDATE_CHECK": "1", "ORS_USE_STRUCTURED_LOGS": "0",
           "NO_PROXY": "127.0.0.1"}
    process = subprocess.Popen([python, str(SERVE), sdk, str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the {sdk} server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the {sdk} server did not start within 120 s")


async def episodes(env: ORSEnvironment, count: int, offset: int, latencies: list[float]) -> None:
    for i in range(count):
        task = {"id": f"t{(offset + i) % 4}", "question": "?", "answer": ANSWERS[f"t{(offset + i) % 4}"]}
        session = await env.open(task)
        try:
            await session.prompt()
            for name, args in (("hint", {}), ("note", {"text": "x"}), ("answer", {"answer": task["answer"]})):
                started = time.perf_counter()
                result = await session.call(name, args)
                latencies.append(time.perf_counter() - started)
                if not hasattr(result, "blocks"):
                    raise RuntimeError(f"{name} failed: {result}")
        finally:
            await session.close()


async def measure(url: str, sessions: int, per_session: int) -> dict[str, Any]:
    env = ORSEnvironment(ORSOptions(url=url, env_name="arithenv", request_timeout_s=120,
                                    heartbeat_timeout_s=120))
    await episodes(env, 2, 0, [])  # warm up connections and imports
    latencies: list[float] = []
    started = time.perf_counter()
    await asyncio.gather(*(episodes(env, per_session, k, latencies) for k in range(sessions)))
    elapsed = time.perf_counter() - started
    await env.close()
    latencies.sort()
    return {
        "sessions": sessions,
        "episodes": sessions * per_session,
        "seconds": round(elapsed, 3),
        "episodes_per_s": round(sessions * per_session / elapsed, 2),
        "tool_call_p50_ms": round(1000 * statistics.median(latencies), 2),
        "tool_call_p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
        "tool_calls": len(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequential-episodes", type=int, default=100)
    parser.add_argument("--episodes-per-session", type=int, default=5)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "ors_server.json")
    args = parser.parse_args()
    openreward_python = VENVS / "openreward" / "bin" / "python"
    if not openreward_python.exists():
        sys.exit(f"{openreward_python} is missing: run scripts/ci/sdk.sh first")

    servers = {"plait": sys.executable, "openreward": str(openreward_python)}
    results: dict[str, dict[str, Any]] = {name: {} for name in servers}
    for concurrency in args.concurrency:
        per_session = args.sequential_episodes if concurrency == 1 else args.episodes_per_session
        for name, python in servers.items():  # one after the other, each in its own process
            process, url = start(python, name)
            try:
                results[name][str(concurrency)] = asyncio.run(measure(url, concurrency, per_session))
            finally:
                process.terminate()
                process.wait(timeout=30)
            print(name, concurrency, results[name][str(concurrency)], flush=True)
    ratios = {
        c: {
            "episodes_per_s (plait / openreward)": round(
                results["plait"][c]["episodes_per_s"] / results["openreward"][c]["episodes_per_s"], 2),
            "tool_call_p50 (openreward / plait)": round(
                results["openreward"][c]["tool_call_p50_ms"] / results["plait"][c]["tool_call_p50_ms"], 2),
            "tool_call_p99 (openreward / plait)": round(
                results["openreward"][c]["tool_call_p99_ms"] / results["plait"][c]["tool_call_p99_ms"], 2),
        }
        for c in results["plait"]
    }
    report = {
        "benchmark": "ors_server",
        "what": "episodes (create, prompt, 3 tool calls, delete) over loopback HTTP, one client process",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_end": os.getloadavg()},
        "results": results,
        "ratios": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
