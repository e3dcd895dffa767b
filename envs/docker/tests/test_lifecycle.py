"""Labels, the janitor after a crash, pool reuse, and the image and CLI commands, on the real
engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from plait_docker.cli import docker_commands
from plait_docker.engine import LABEL_OWNER_PID, LABEL_POOL, LABEL_SANDBOX
from plait_docker.image import DEFAULT_RECIPE, build_image
from plait_docker.sandbox import Sandbox, SandboxClosedError, SandboxOptions, janitor, owner_label

pytestmark = pytest.mark.docker

CRASHING_OWNER = textwrap.dedent("""
    import sys, time
    from plait_docker.sandbox import Sandbox, SandboxOptions
    box = Sandbox(SandboxOptions(pool_size=2))
    print("POOL", box.pool_id, flush=True)
    time.sleep(600)
""")


def test_janitor_removes_the_containers_of_a_crashed_owner(engine):
    owner = subprocess.Popen(
        [sys.executable, "-c", CRASHING_OWNER], stdout=subprocess.PIPE, text=True
    )
    try:
        pool_id = next(line.split()[1] for line in owner.stdout if line.startswith("POOL "))
        assert len(engine.pool_containers(pool_id)) == 2
    finally:
        owner.send_signal(signal.SIGKILL)  # a crash: no close(), no atexit
        owner.wait()
    leftovers = engine.pool_containers(pool_id)
    assert len(leftovers) == 2
    labels = leftovers[0].labels
    assert labels[LABEL_SANDBOX] == "1" and labels[LABEL_POOL] == pool_id
    assert labels[LABEL_OWNER_PID].startswith(f"{owner.pid}:")

    removed = janitor(engine.client)
    assert sorted(removed) == sorted(c.name for c in leftovers)
    assert engine.pool_containers(pool_id) == []


def test_janitor_spares_live_owners_and_a_new_sandbox_runs_it(engine):
    with Sandbox(SandboxOptions(pool_size=1)) as box:
        assert janitor(engine.client) == []
        assert len(engine.pool_containers(box.pool_id)) == 1
        assert engine.pool_containers(box.pool_id)[0].labels[LABEL_OWNER_PID] == owner_label()


def test_warm_containers_are_reused_and_fresh_mode_creates_one_per_execution(engine):
    with Sandbox(SandboxOptions(pool_size=1)) as warm:
        hostnames = {
            warm.execute("import os\nprint(os.stat('/proc/1').st_ctime)").stdout for _ in range(3)
        }
        assert len(hostnames) == 1  # the same PID 1: one container served all three
        assert len(engine.pool_containers(warm.pool_id)) == 1
    assert engine.pool_containers(warm.pool_id) == []

    with Sandbox(SandboxOptions(pool_size=1, reuse_containers=False)) as fresh:
        assert engine.pool_containers(fresh.pool_id) == []  # nothing pre-warmed
        starts = {
            fresh.execute("import os\nprint(os.stat('/proc/1').st_ctime)").stdout for _ in range(3)
        }
        assert engine.pool_containers(fresh.pool_id) == []  # each removed after its execution
    assert len(starts) == 3


def test_a_closed_sandbox_refuses_work(engine):
    box = Sandbox(SandboxOptions(pool_size=1))
    box.close()
    box.close()  # twice is fine
    with pytest.raises(SandboxClosedError):
        box.execute("print(1)")


def test_programs_too_large_for_an_exec_are_refused_without_running():
    with Sandbox(SandboxOptions(pool_size=1, max_program_bytes=1000)) as box:
        result = box.execute("x = 1\n" * 500)
        assert result.reason == "program_too_large" and not result.ok
        assert "3000 bytes" in result.detail


def test_build_image_is_idempotent(engine):
    before = engine.client.images.get(DEFAULT_RECIPE.tag).id
    assert build_image() == DEFAULT_RECIPE.tag
    image = engine.client.images.get(DEFAULT_RECIPE.tag)
    assert image.id == before
    assert image.labels["plait.sandbox-image.recipe"] == DEFAULT_RECIPE.digest()


def test_cli_status_and_janitor(engine):
    runner = CliRunner()
    status = runner.invoke(docker_commands, ["status"])
    assert status.exit_code == 0, status.output
    assert DEFAULT_RECIPE.tag in status.output and "(built)" in status.output
    swept = runner.invoke(docker_commands, ["janitor"])
    assert swept.exit_code == 0 and "removed" in swept.output


def test_plait_docker_console_script_reports_errors_without_a_traceback(tmp_path):
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/nothing.sock"}
    proc = subprocess.run(
        [sys.executable, "-m", "plait_docker", "status"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: no Docker engine is reachable")
    assert "fix: start a Docker engine" in proc.stderr
    assert "Traceback" not in proc.stderr
