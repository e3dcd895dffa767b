"""The execution API on the real engine: stdin, what the host's process list shows, ordinary
programs under the seccomp profile, and faults of the engine (a stopped runner, a paused or
killed container) reported as such, quickly, and never as the program's failure."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import textwrap
import time
import uuid

import pytest

from plait_docker.image import DEFAULT_RECIPE
from plait_docker.sandbox import Sandbox, SandboxOptions

pytestmark = pytest.mark.docker

# The result of an engine fault must come back within the timeout plus this.
FAULT_MARGIN_S = 3.0


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxOptions(pool_size=1, timeout_s=5)) as box:
        yield box


def test_stdin_reaches_the_program(sandbox):
    reversed_line = sandbox.execute("print(input()[::-1])", stdin="abc\n")
    assert (reversed_line.reason, reversed_line.stdout) == ("ok", "cba\n"), reversed_line
    big = "hello" + "x" * 300_000
    counted = sandbox.execute(
        "import sys\ndata = sys.stdin.read()\nprint(len(data), data[:5])", stdin=big
    )
    assert (counted.reason, counted.stdout) == ("ok", "300005 hello\n"), counted
    ignored = sandbox.execute("print('did not read it')", stdin="x" * 1_000_000)  # must not hang
    assert (ignored.reason, ignored.stdout) == ("ok", "did not read it\n"), ignored
    nothing = sandbox.execute("input()")
    assert nothing.reason == "error" and "EOFError" in nothing.stderr


def test_too_much_stdin_is_refused_without_running(sandbox):
    result = sandbox.execute("print(1)", stdin="x" * (sandbox.options.max_stdin_bytes + 1))
    assert result.reason == "program_too_large" and "input" in result.detail


def _cmdlines() -> dict[int, bytes]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    found[int(entry)] = f.read()
            except OSError:
                pass
    return found


def _runner_pids() -> list[int]:
    """Host PIDs of sandbox runners (`python3 -I -B -c RUNNER ...` as the sandbox user)."""
    pids = []
    for pid, cmdline in _cmdlines().items():
        if cmdline.split(b"\0")[1:4] != [b"-I", b"-B", b"-c"]:
            continue
        try:  # not the owner of /proc/PID: the runner is not dumpable, which makes that root
            with open(f"/proc/{pid}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if uid == DEFAULT_RECIPE.sandbox_uid:
            pids.append(pid)
    return pids


def _wait_for_runner(timeout_s: float = 10.0) -> int:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        pids = _runner_pids()
        if pids:
            return pids[0]
        time.sleep(0.02)
    raise AssertionError("no sandbox runner appeared on the host")


def test_program_source_is_not_in_the_host_process_list(sandbox):
    marker = f"PLAIT-HIDDEN-TEST-{uuid.uuid4().hex}"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(sandbox.execute, f"# {marker}\nimport time\ntime.sleep(1.5)\n")
        _wait_for_runner()
        seen = []
        while not future.done():
            seen += [pid for pid, cmdline in _cmdlines().items() if marker.encode() in cmdline]
            time.sleep(0.05)
    assert future.result().ok
    assert seen == []


ORDINARY = textwrap.dedent("""
    import asyncio, concurrent.futures, ctypes, hashlib, multiprocessing, os, select, signal, socket
    import sqlite3, subprocess, sys, tempfile, threading, time, zlib

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(lambda x: x * x, range(100))) == 328350
    run = lambda argv: subprocess.run(argv, capture_output=True, text=True).stdout
    assert run([sys.executable, "-c", "print(6 * 7)"]) == "42\\n"
    assert run(["sh", "-c", "echo $((1 + 1))"]) == "2\\n"
    read_end, write_end = os.pipe()
    if (pid := os.fork()) == 0:
        os.write(write_end, b"child")
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0 and os.read(read_end, 5) == b"child"
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=child.send, args=("from a process",))
    process.start()
    process.join()
    assert parent.recv() == "from a process" and process.exitcode == 0
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    client.sendall(b"ping")
    assert accepted.recv(4) == b"ping"

    async def main():
        reader, writer = await asyncio.open_connection(*server.getsockname())
        writer.close()
        await asyncio.sleep(0.01)
        return 5

    assert asyncio.run(main()) == 5
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "f"), "w") as f:
            f.write("data")
        os.rename(os.path.join(tmp, "f"), os.path.join(tmp, "g"))
        assert os.listdir(tmp) == ["g"]
    db = sqlite3.connect(":memory:")
    assert db.execute("select 1 + 1").fetchone() == (2,)
    values = (ctypes.c_int * 4)(3, 1, 2, 0)
    int_pointer = ctypes.POINTER(ctypes.c_int)
    compare = ctypes.CFUNCTYPE(ctypes.c_int, int_pointer, int_pointer)
    by_value = compare(lambda a, b: a[0] - b[0])
    ctypes.CDLL(None).qsort(values, 4, ctypes.sizeof(ctypes.c_int), by_value)
    assert list(values) == [0, 1, 2, 3]
    fired = threading.Event()
    signal.signal(signal.SIGALRM, lambda *_: fired.set())
    signal.setitimer(signal.ITIMER_REAL, 0.02)
    assert fired.wait(2)
    select.epoll().close()
    assert os.sched_getaffinity(0) and os.cpu_count() and len(os.urandom(8)) == 8
    assert zlib.decompress(zlib.compress(b"x" * 100)) == b"x" * 100
    assert hashlib.sha256(b"").hexdigest()
    os.mkfifo("fifo")
    print("ALL OK")
    """)


def test_ordinary_programs_work_under_the_seccomp_profile(sandbox):
    result = sandbox.execute(ORDINARY, timeout_s=20)
    assert (result.reason, result.stdout) == ("ok", "ALL OK\n"), result


# ------------------------------------------------------------------------------------------------
# Engine faults: not the program's doing, reported as such within the timeout plus a small margin
# ------------------------------------------------------------------------------------------------

SLOW_PROGRAM = "import time\ntime.sleep(8)\nprint('finished')\n"
TIMEOUT_S = 10.0


@pytest.fixture
def fault_box():
    with Sandbox(SandboxOptions(pool_size=1, timeout_s=TIMEOUT_S)) as box:
        yield box


def _execute_while(box: Sandbox, interfere) -> tuple[object, float]:
    """Run SLOW_PROGRAM and call `interfere()` once its runner is up; (result, seconds taken)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        future = pool.submit(box.execute, SLOW_PROGRAM)
        _wait_for_runner()
        time.sleep(0.5)
        interfere()
        result = future.result(timeout=60)
    return result, time.monotonic() - started


def _assert_engine_fault(result, took: float, *words: str) -> None:
    assert result.reason == "sandbox_error", result
    assert result.engine_fault
    assert any(w in result.detail for w in words), result.detail
    assert "program" not in result.detail, result.detail  # not worded as if the program did it
    assert took < TIMEOUT_S + FAULT_MARGIN_S, took


def test_a_stopped_runner_is_an_engine_fault_reported_in_time(fault_box):
    stopped = []

    def stop_the_runner():
        stopped.append(_wait_for_runner())
        os.kill(stopped[0], signal.SIGSTOP)

    try:
        result, took = _execute_while(fault_box, stop_the_runner)
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    _assert_engine_fault(result, took, "stopped responding")
    assert fault_box.execute("print('next')").stdout == "next\n"


def test_a_paused_container_is_an_engine_fault_not_a_timeout(fault_box, engine):
    (container,) = engine.pool_containers(fault_box.pool_id)
    result, took = _execute_while(fault_box, container.pause)
    _assert_engine_fault(result, took, "paused")
    assert fault_box.execute("print('next')").stdout == "next\n"  # on a fresh container


def test_a_container_killed_from_outside_is_an_engine_fault(fault_box, engine):
    (container,) = engine.pool_containers(fault_box.pool_id)
    result, took = _execute_while(fault_box, container.kill)
    _assert_engine_fault(result, took, "killed", "stopped")
    assert fault_box.execute("print('next')").stdout == "next\n"
