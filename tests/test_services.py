"""Every component a service: the test-sized example with its trainer in a `plait serve trainer`
process, its inference engine in a `plait serve inference` process (both launched by the run) and
its environment on an ORS server (`plait env serve`), the controller alone in `plait run`; the
config differs from the in-process run (tests/test_learning_arith_tiny.py) only in where the
components live and in weights travelling by disk (the trainer service writes each version where
the inference service loads it). Mid-run the inference service is SIGKILLed: the run launches it
again with the weights it had, sends its running requests once more, learns as the in-process run
does, and trains every prompt's every sample exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("plait_remote")

KILL_AFTER_STEPS = 8


@pytest.fixture
def arith_ors_url(tmp_path: Path) -> Iterator[str]:
    """math.arith (tiny preset) served over ORS by `plait env serve`."""
    from plait_server.engine import free_port

    port = free_port()
    log = (tmp_path / "ors.log").open("wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "env",
            "serve",
            "math.arith",
            "-o",
            "preset=tiny",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (tmp_path / "ors.log").read_text()[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the ORS server did not start"
            time.sleep(0.3)
        yield url
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def inference_service_pids(run_marker: str) -> list[int]:
    """The `plait serve inference` processes whose parent's command line contains `run_marker`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"serve" not in argv or b"inference" not in argv:
                continue
            parent = (proc / "stat").read_text().rsplit(")", 1)[1].split()[1]
            if run_marker.encode() in Path(f"/proc/{parent}/cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:  # it exited while we looked
            continue
    return found


def steps_done(out_dir: Path) -> int:
    metrics = next(out_dir.glob("*/metrics.jsonl"), None)
    if metrics is None:
        return 0
    return sum(
        1
        for line in metrics.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] > 0
    )


@pytest.mark.timeout(2400)  # the first run also builds tiny-qwen3-arith (minutes)
def test_arith_tiny_learns_with_every_component_a_service_through_a_sigkill(
    run_arith_tiny, arith_ors_url: str, tmp_path: Path
) -> None:
    killed: list[int] = []

    def kill_the_inference_service_mid_run() -> None:
        deadline = time.monotonic() + 2000
        while time.monotonic() < deadline and not killed:
            if steps_done(tmp_path) >= KILL_AFTER_STEPS:
                for pid in inference_service_pids(str(tmp_path)):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.2)

    killer = threading.Thread(target=kill_the_inference_service_mid_run, daemon=True)
    killer.start()
    run = run_arith_tiny(
        "trainer.engine=remote",
        'trainer.options={engine="torch"}',
        "inference.engine=remote",
        'inference.options={engine="torch"}',
        "env.name=ors",
        f'env.options={{url="{arith_ors_url}"}}',
        "sync.method=disk",
    )
    killer.join(timeout=5)

    assert len(killed) == 1, f"one inference service to kill, found {killed}"
    assert "restarting it and re-issuing its running requests" in run.output
    run.assert_learned()
    records = [
        json.loads(line) for line in (run.run_dir / "trained.jsonl").read_text().splitlines()
    ]
    groups, group_size = 16, 8  # examples/arith_tiny.toml
    trained = Counter((position, index) for r in records for position, index, *_ in r["samples"])
    assert set(trained) == {(p, i) for p in range(run.steps * groups) for i in range(group_size)}
    assert set(trained.values()) == {1}, "a sample trained twice"
