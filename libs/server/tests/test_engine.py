"""plait_server.engine: server processes never outlive their launcher, start-up failures are
bounded and explained, and the wire helpers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from plait.errors import EngineError
from plait_server.engine import PauseGate, ServerProcess, parse_weight_version, token_versions


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


LAUNCHER = textwrap.dedent("""
    import sys, time
    from plait_server.engine import ServerProcess
    server = ServerProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"],
                           log_path=sys.argv[1])
    print(server.pid, flush=True)
    sys.stdin.readline()  # the test checks the server is up before the launcher goes on
    if sys.argv[2] == "hang":
        time.sleep(120)
""")


@pytest.mark.parametrize("how", ["exit", "killed"])
def test_server_dies_with_its_launcher(tmp_path: Path, how: str) -> None:
    """Normal interpreter exit (atexit) and a SIGKILLed launcher (PR_SET_PDEATHSIG) both take
    the server down."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "log"), "hang" if how == "killed" else "exit"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    server_pid = next(int(line) for line in launcher.stdout if line.strip().isdigit())  # logs go to stdout too
    assert alive(server_pid)
    launcher.stdin.write("go\n")
    launcher.stdin.flush()
    if how == "killed":
        launcher.kill()
    rest = launcher.stdout.read()
    launcher.wait(30)
    assert wait_gone(server_pid, timeout=30), f"server {server_pid} outlived its launcher ({how}): {rest}"


def test_start_up_crash_is_reported_with_the_log(tmp_path: Path) -> None:
    server = ServerProcess("crasher", [sys.executable, "-c", "print('bad flag --foo'); raise SystemExit(3)"],
                           log_path=tmp_path / "log")

    async def never_healthy() -> bool:
        return False

    started = time.monotonic()
    with pytest.raises(EngineError, match=r"(?s)exited with code 3 while starting.*bad flag --foo"):
        asyncio.run(server.wait_healthy(never_healthy, timeout_s=60, poll_s=0.05))
    assert time.monotonic() - started < 30
    server.stop()


def test_start_up_timeout_stops_the_server(tmp_path: Path) -> None:
    server = ServerProcess("slow", [sys.executable, "-c", "import time; print('loading'); time.sleep(60)"],
                           log_path=tmp_path / "log")

    async def never_healthy() -> bool:
        return False

    with pytest.raises(EngineError, match=r"(?s)did not become healthy within 0.5 s.*startup_timeout_s"):
        asyncio.run(server.wait_healthy(never_healthy, timeout_s=0.5, poll_s=0.05))
    assert wait_gone(server.pid)


def test_pause_gate_holds_and_bounds() -> None:
    async def body() -> None:
        gate = PauseGate()
        await asyncio.wait_for(gate.wait_open(), 1)  # open: returns at once
        gate.pause()
        waiter = asyncio.ensure_future(gate.wait_open())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        gate.resume()
        await asyncio.wait_for(waiter, 1)
        gate.pause()
        with pytest.raises(EngineError, match="stayed paused"):
            await gate.wait_open(timeout_s=0.05)

    asyncio.run(body())


def test_weight_version_labels_and_spans() -> None:
    assert parse_weight_version("default") == 0 and parse_weight_version("12") == 12
    with pytest.raises(EngineError, match="did not set"):
        parse_weight_version("step-3")
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5, fallback=9) == (0, 0, 4, 4, 4)
    assert token_versions(None, 3, fallback=7) == (7, 7, 7)
