"""plait_server.engine: server processes never outlive their launcher, start-up failures are
bounded and explained, a launched server that dies is restarted with its weights, and the wire
helpers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from plait.api import EngineError, ResolvedModel
from plait_server.engine import (
    PauseGate,
    ServerEngine,
    ServerOptions,
    ServerProcess,
    free_port,
    parse_weight_version,
    token_versions,
)


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
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LAUNCHER,
            str(tmp_path / "log"),
            "hang" if how == "killed" else "exit",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    server_pid = next(
        int(line) for line in launcher.stdout if line.strip().isdigit()
    )  # logs go to stdout too
    assert alive(server_pid)
    launcher.stdin.write("go\n")
    launcher.stdin.flush()
    if how == "killed":
        launcher.kill()
    rest = launcher.stdout.read()
    launcher.wait(30)
    assert wait_gone(server_pid, timeout=30), (
        f"server {server_pid} outlived its launcher ({how}): {rest}"
    )


def test_start_up_crash_is_reported_with_the_log(tmp_path: Path) -> None:
    server = ServerProcess(
        "crasher",
        [sys.executable, "-c", "print('bad flag --foo'); raise SystemExit(3)"],
        log_path=tmp_path / "log",
    )

    async def never_healthy() -> bool:
        return False

    started = time.monotonic()
    with pytest.raises(EngineError, match=r"(?s)exited with code 3 while starting.*bad flag --foo"):
        asyncio.run(server.wait_healthy(never_healthy, timeout_s=60, poll_s=0.05))
    assert time.monotonic() - started < 30
    server.stop()


def test_start_up_timeout_stops_the_server(tmp_path: Path) -> None:
    server = ServerProcess(
        "slow",
        [sys.executable, "-c", "import time; print('loading'); time.sleep(60)"],
        log_path=tmp_path / "log",
    )

    async def never_healthy() -> bool:
        return False

    with pytest.raises(
        EngineError, match=r"(?s)did not become healthy within 0.5 s.*startup_timeout_s"
    ):
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


# ---------------------------------------------------------------------------------------------
# Restarts: a launched server that dies comes back with its weights, its requests re-issued
# ---------------------------------------------------------------------------------------------

STUB_SERVER = textwrap.dedent("""
    import json, os, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state = {"weights": None, "version": 0, "adapters": {}, "hold": False, "held": 0, "sick": False}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self.reply(500 if state["sick"] else 200, {})
            elif self.path == "/held":
                self.reply(200, {"held": state["held"]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
            if self.path == "/generate":
                if state["sick"]:
                    return self.reply(500, {"error": "EngineCore encountered an issue"})
                if state["hold"]:  # a running request: it never ends on this server
                    with lock:
                        state["held"] += 1
                    time.sleep(3600)
                self.reply(200, {"pid": os.getpid(), "weights": state["weights"],
                                 "version": state["version"], "adapters": state["adapters"]})
            elif self.path == "/load":
                state["weights"], state["version"] = body["path"], body["version"]
                self.reply(200, {})
            elif self.path == "/version":
                state["version"] = body["version"]
                self.reply(200, {})
            elif self.path == "/adapter":
                state["adapters"][body["name"]] = body["path"]
                self.reply(200, {})
            elif self.path in ("/hold", "/sick"):
                state[self.path[1:]] = True
                self.reply(200, {})

    print("stub server starting on port", sys.argv[1], flush=True)
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
""")


class StubEngine(ServerEngine):
    """A `ServerEngine` on the stub server above: its replies show which process answered and
    which weights, version and adapters that process was given."""

    server_name = "stub"

    def launch_command(self, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        return [sys.executable, "-c", STUB_SERVER, str(port)], {}

    async def generate(self) -> dict:
        async def send():
            return await self.http.request(
                "POST", "/generate", json={}, timeout_s=self.options.request_timeout_s
            )

        return (await self._reissued_after_restart(send, in_flight=True)).json()

    async def _load_weights_from_disk(self, path: str, version: int) -> None:
        await self._ensure_ready()
        await self.http.request("POST", "/load", json={"path": path, "version": version})
        self._version = version

    async def _set_weight_version(self, version: int) -> None:
        await self._ensure_ready()
        await self.http.request("POST", "/version", json={"version": version})
        self._version = version

    async def _load_lora_adapter(self, name: str, path: str) -> None:
        await self._ensure_ready()
        await self.http.request("POST", "/adapter", json={"name": name, "path": path})


@pytest.fixture
def stub_model(tmp_path: Path) -> ResolvedModel:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100}))
    return ResolvedModel("stub", tmp_path, tmp_path)


def stub_engine(model: ResolvedModel, tmp_path: Path, **options) -> StubEngine:
    return StubEngine(
        model,
        ServerOptions(
            log_path=str(tmp_path / "stub.log"),
            request_timeout_s=60.0,
            control_timeout_s=10.0,
            startup_timeout_s=60.0,
            **options,
        ),
        seed=0,
    )


async def kill_when_holding(engine: StubEngine, requests: int) -> int:
    """SIGKILL the engine's server once `requests` requests are running on it; its pid."""
    while (await engine.http.json("GET", "/held"))["held"] < requests:
        await asyncio.sleep(0.02)
    pid = engine.server.pid
    os.killpg(pid, signal.SIGKILL)
    return pid


def test_a_server_killed_mid_request_is_restarted_with_its_weights(
    stub_model: ResolvedModel, tmp_path: Path
) -> None:
    """Requests running when the server dies complete on a new server, which has been given the
    weights the dead one had (last directory loaded, the later version bump, the adapters)
    before any of them reaches it; one warning names the exit code and the log file."""

    async def body() -> None:
        engine = stub_engine(stub_model, tmp_path)
        try:
            await engine.load_weights_from_disk(str(tmp_path / "v3"), 3)
            await engine.set_weight_version(4)
            await engine.load_lora_adapter("a1", str(tmp_path / "adapter"))
            await engine.http.request("POST", "/hold")
            running = [asyncio.ensure_future(engine.generate()) for _ in range(3)]
            with capture_logs() as logs:
                dead_pid = await kill_when_holding(engine, 3)
                replies = await asyncio.gather(*running)
            assert {r["pid"] for r in replies} == {
                engine.server.pid
            } and engine.server.pid != dead_pid
            assert all(r["weights"] == str(tmp_path / "v3") and r["version"] == 4 for r in replies)
            assert all(r["adapters"] == {"a1": str(tmp_path / "adapter")} for r in replies)
            assert engine.restarts == 1 and engine.weight_version == 4
            [warning] = [e for e in logs if e["log_level"] == "warning"]
            assert "exited with code -9" in warning["event"] and warning["log"] == str(
                tmp_path / "stub.log"
            )
            assert (await engine.generate())["pid"] == engine.server.pid  # and it keeps serving
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 120))


@pytest.mark.slow  # a server killed and launched again: with the slow tests (make check < 5 min)
def test_a_server_alive_but_failing_is_replaced(stub_model: ResolvedModel, tmp_path: Path) -> None:
    """vLLM's API server outlives its dead EngineCore for a while, answering 500 (health too):
    a failed request on a server that no longer answers /health restarts it as well."""

    async def body() -> None:
        engine = stub_engine(stub_model, tmp_path)
        try:
            first = await engine.generate()
            await engine.http.request("POST", "/sick")
            second = await engine.generate()
            assert second["pid"] != first["pid"] and engine.restarts == 1
            assert wait_gone(first["pid"]), "the failing server is stopped"
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 120))


def test_restarts_are_bounded(stub_model: ResolvedModel, tmp_path: Path) -> None:
    """A server found dead between requests is restarted too; past max_restarts the engine gives
    up with an error that names the count and shows the log's last lines."""

    async def body() -> None:
        engine = stub_engine(stub_model, tmp_path, max_restarts=1)
        try:
            await engine.generate()
            os.killpg(engine.server.pid, signal.SIGKILL)
            engine.server.process.wait(10)
            await engine.generate()
            assert engine.restarts == 1
            await engine.http.request("POST", "/hold")
            running = asyncio.ensure_future(engine.generate())
            await kill_when_holding(engine, 1)
            with pytest.raises(
                EngineError,
                match=r"(?s)exited with code -9 after 1 restarts.*"
                r"max_restarts = 1.*stub server starting",
            ) as failure:
                await running
            assert "max_restarts" in failure.value.fix
            with pytest.raises(EngineError, match="after 1 restarts"):  # and stays down
                await engine.generate()
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 120))


def test_weights_that_came_by_broadcast_are_not_guessed(
    stub_model: ResolvedModel, tmp_path: Path
) -> None:
    """A new server cannot get weights that exist nowhere on disk: a clear error, no restart."""

    async def body() -> None:
        engine = stub_engine(stub_model, tmp_path)
        try:
            await engine.generate()
            engine._weights_from_broadcast = True  # as a broadcast weight update leaves it
            os.killpg(engine.server.pid, signal.SIGKILL)
            engine.server.process.wait(10)
            with pytest.raises(
                EngineError, match="could not be given its weights: its weights came by broadcast"
            ):
                await engine.generate()
            assert engine.restarts == 0
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 120))


def test_an_attached_server_is_not_restarted(stub_model: ResolvedModel, tmp_path: Path) -> None:
    async def body() -> None:
        port = free_port()
        server = ServerProcess(
            "stub", [sys.executable, "-c", STUB_SERVER, str(port)], log_path=tmp_path / "log"
        )
        engine = StubEngine(
            stub_model, ServerOptions(url=f"http://127.0.0.1:{port}", control_timeout_s=5.0), seed=0
        )
        try:
            await server.wait_healthy(engine._healthy, timeout_s=60, poll_s=0.05)
            await engine.generate()
            server.stop()
            with pytest.raises(EngineError, match="cannot reach") as failure:
                await engine.generate()
            assert "restarts only servers it launched" in failure.value.fix
        finally:
            await engine.close()
            server.stop()

    asyncio.run(asyncio.wait_for(body(), 120))
