"""ORS server throughput and tool-call latency: plait's server vs openreward's, side by side.

Both servers run the same environment (sdk/tests/interop/arith_env.py, written for `ors`; only its
import line differs) as separate processes on loopback. One client process plays episodes against
each: create a session (/create_session, /create), read the prompt, call three tools (hint, note,
answer), delete it (/delete, /delete_session). Measured at 1 and 64 concurrent sessions:
episodes/s, the p50/p99 latency of a tool call (a whole /call SSE round trip, seen by the client),
and the CPU time each server process and the client spent per episode.

The default client (`--client raw`) is a minimal HTTP/1.1 keep-alive load generator, one
connection per session, that sends exactly the requests plait's client sends: it spends a fraction
of the servers' CPU time per episode, so the servers are what is measured (with plait's own client,
`--client plait`, the client costs about as much CPU as the server and, on a small machine, limits
both). The servers run one after the other, `--repeats` times alternating; the best run of each
counts (the machine's other load only ever slows a run down). Writes
benchmarks/results/ors_server.json.

    python benchmarks/ors_server.py [--client raw|plait] [--repeats 3] [--episodes-per-session 10]

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
    env = {
        **os.environ,
        "OPENREWARD_DISABLE_UPDATE_CHECK": "1",
        "ORS_USE_STRUCTURED_LOGS": "0",
        "NO_PROXY": "127.0.0.1",
    }
    process = subprocess.Popen(
        [python, str(SERVE), sdk, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
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


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def episode_task(n: int) -> dict[str, str]:
    task_id = f"t{n % 4}"
    return {"id": task_id, "question": "?", "answer": ANSWERS[task_id]}


TOOL_CALLS = (("hint", {}), ("note", {"text": "x"}), ("answer", None))  # None: the task's answer


async def plait_episodes(
    env: ORSEnvironment, count: int, offset: int, latencies: list[float]
) -> None:
    for i in range(count):
        task = episode_task(offset + i)
        session = await env.open(task)
        try:
            await session.prompt()
            for name, args in TOOL_CALLS:
                started = time.perf_counter()
                result = await session.call(
                    name, args if args is not None else {"answer": task["answer"]}
                )
                latencies.append(time.perf_counter() - started)
                if not hasattr(result, "blocks"):
                    raise RuntimeError(f"{name} failed: {result}")
        finally:
            await session.close()


class RawConnection:
    """One keep-alive HTTP/1.1 connection that reads just what ORS servers send (a Content-Length
    or a chunked body) and nothing more: a load generator that costs the client little CPU."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(
        self, method: str, path: str, *, sid: str | None = None, body: Any = None
    ) -> bytes:
        if self.reader is None or self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            self.writer.get_extra_info("socket").setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
        payload = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n"
            + (f"X-Session-ID: {sid}\r\n" if sid else "")
            + "\r\n"
        )
        self.writer.write(head.encode() + payload)
        lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (line.partition(":") for line in lines[1:] if line)
        }
        if "content-length" in headers:
            data = await self.reader.readexactly(int(headers["content-length"]))
        else:  # chunked (the SSE answers)
            parts = []
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                parts.append((await self.reader.readexactly(size + 2))[:-2])
            await self.reader.readuntil(b"\r\n")
            data = b"".join(parts)
        if headers.get("connection", "").lower() == "close":
            self.writer.close()
            self.reader = self.writer = None
        if status != 200:
            raise RuntimeError(f"{method} {path} answered {status}: {data[:300]!r}")
        return data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def sse_result(stream: bytes) -> Any:
    """The JSON result of an SSE answer: its chunk and end pieces joined."""
    pieces, current = [], ""
    for line in stream.decode().splitlines():
        if line.startswith("event:"):
            current = line[6:].strip()
        elif line.startswith("data:") and current in ("chunk", "end"):
            pieces.append(line[5:].lstrip())
    return json.loads("".join(pieces))


async def raw_episodes(
    connection: RawConnection, env_name: str, count: int, offset: int, latencies: list[float]
) -> None:
    """The requests plait's client sends for an episode, over one connection."""
    for i in range(count):
        task = episode_task(offset + i)
        opened = await connection.request("POST", "/create_session", body={})
        sid = opened.split(b"data:", 1)[1].split(b"\n", 1)[0].strip().decode()
        await connection.request(
            "POST", "/create", sid=sid, body={"env_name": env_name, "task_spec": task}
        )
        try:
            json.loads(await connection.request("GET", f"/{env_name}/prompt", sid=sid))
            for name, args in TOOL_CALLS:
                started = time.perf_counter()
                answer = await connection.request(
                    "POST",
                    f"/{env_name}/call",
                    sid=sid,
                    body={
                        "name": name,
                        "input": args if args is not None else {"answer": task["answer"]},
                    },
                )
                latencies.append(time.perf_counter() - started)
                if not sse_result(answer).get("ok"):
                    raise RuntimeError(f"{name} failed: {answer[:300]!r}")
        finally:
            await connection.request("POST", "/delete", sid=sid)
            await connection.request("POST", "/delete_session", sid=sid)


async def measure(
    url: str, sessions: int, per_session: int, client: str, server_pid: int
) -> dict[str, Any]:
    env_name = "arithenv"
    host, port = url.removeprefix("http://").split(":")
    connections = [RawConnection(host, int(port)) for _ in range(sessions)]
    env = ORSEnvironment(
        ORSOptions(url=url, env_name=env_name, request_timeout_s=120, heartbeat_timeout_s=120)
    )

    def play(k: int, count: int, latencies: list[float]) -> Any:
        if client == "raw":
            return raw_episodes(connections[k], env_name, count, k, latencies)
        return plait_episodes(env, count, k, latencies)

    await play(0, 2, [])  # warm up connections and imports
    latencies: list[float] = []
    server_cpu, client_cpu = process_cpu_s(server_pid), time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(play(k, per_session, latencies) for k in range(sessions)))
    elapsed = time.perf_counter() - started
    server_cpu, client_cpu = (
        process_cpu_s(server_pid) - server_cpu,
        time.process_time() - client_cpu,
    )
    await env.close()
    for connection in connections:
        connection.close()
    latencies.sort()
    episodes = sessions * per_session
    return {
        "sessions": sessions,
        "episodes": episodes,
        "seconds": round(elapsed, 3),
        "episodes_per_s": round(episodes / elapsed, 2),
        "tool_call_p50_ms": round(1000 * statistics.median(latencies), 2),
        "tool_call_p99_ms": round(
            1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2
        ),
        "tool_calls": len(latencies),
        "server_cpu_ms_per_episode": round(1000 * server_cpu / episodes, 2),
        "client_cpu_ms_per_episode": round(1000 * client_cpu / episodes, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--client", choices=["raw", "plait"], default="raw")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sequential-episodes", type=int, default=100)
    parser.add_argument("--episodes-per-session", type=int, default=10)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "ors_server.json"
    )
    args = parser.parse_args()
    openreward_python = VENVS / "openreward" / "bin" / "python"
    if not openreward_python.exists():
        sys.exit(f"{openreward_python} is missing: run scripts/ci/sdk.sh first")

    servers = {"plait": sys.executable, "openreward": str(openreward_python)}
    results: dict[str, dict[str, Any]] = {name: {} for name in servers}
    for concurrency in args.concurrency:
        per_session = args.sequential_episodes if concurrency == 1 else args.episodes_per_session
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        for _ in range(args.repeats):
            for name, python in servers.items():  # alternating, each in its own process
                process, url = start(python, name)
                try:
                    runs[name].append(
                        asyncio.run(
                            measure(url, concurrency, per_session, args.client, process.pid)
                        )
                    )
                finally:
                    process.terminate()
                    process.wait(timeout=30)
                print(name, concurrency, runs[name][-1], flush=True)
        for name, measured in runs.items():
            best = max(measured, key=lambda run: run["episodes_per_s"])
            results[name][str(concurrency)] = {
                **best,
                "episodes_per_s_of_each_run": [r["episodes_per_s"] for r in measured],
            }

    def ratio(c: str, key: str, plait_over_openreward: bool) -> float:
        mine, theirs = results["plait"][c][key], results["openreward"][c][key]
        return round(mine / theirs if plait_over_openreward else theirs / mine, 2)

    ratios = {
        c: {
            "episodes_per_s (plait / openreward)": ratio(c, "episodes_per_s", True),
            "tool_call_p50 (openreward / plait)": ratio(c, "tool_call_p50_ms", False),
            "tool_call_p99 (openreward / plait)": ratio(c, "tool_call_p99_ms", False),
            "server_cpu_per_episode (openreward / plait)": ratio(
                c, "server_cpu_ms_per_episode", False
            ),
        }
        for c in results["plait"]
    }
    report = {
        "benchmark": "ors_server",
        "what": "episodes (create, prompt, 3 tool calls, delete) over loopback HTTP, "
        "one client process",
        "client": args.client,
        "repeats": args.repeats,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_at_end": os.getloadavg(),
        },
        "results": results,
        "ratios": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
