"""Hostile programs: each is contained, reported as a failed execution with its reason, and the
next execution in the same pool works. Runs on the real engine (marker `docker`)."""

from __future__ import annotations

import socket
import textwrap

import pytest

from plait_docker.sandbox import Sandbox, SandboxOptions

pytestmark = pytest.mark.docker


def _egress_target() -> str:
    """A package registry's address (the only outside hosts this machine may contact), resolved
    on the host; the sandbox must not reach it."""
    try:
        return socket.getaddrinfo("pypi.org", 443, socket.AF_INET)[0][4][0]
    except OSError:
        return "pypi.org"


HOSTILE = {
    "network_egress": (f"""
        import os, socket
        print("interfaces:", sorted(os.listdir("/sys/class/net")))
        socket.create_connection(({_egress_target()!r}, 443), timeout=3)
        print("CONNECTED")
        """, {"error"}, "unreachable|Name or service not known|Temporary failure"),
    "dns_lookup": ("""
        import socket
        socket.getaddrinfo("pypi.org", 443)
        print("RESOLVED")
        """, {"error"}, "gaierror"),
    "fork_bomb": ("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """, {"pids_limit"}, ""),
    "memory_bomb": ("""
        hog = []
        while True:
            hog.append(bytearray(32 * 2**20))
        """, {"memory_limit"}, ""),
    "infinite_loop": ("while True:\n    pass\n", {"timeout"}, ""),
    "disk_fill": ("""
        with open("fill", "wb") as f:
            while True:
                f.write(b"x" * 2**20)
        """, {"disk_limit"}, "No space left on device"),
    "writes_outside_work_dir": ("""
        written = []
        for path in ["/etc/evil", "/tmp/evil", "/usr/lib/evil", "/evil", "/root/evil", "/var/tmp/evil",
                     "/dev/shm/evil", "/dev/evil", "/sys/evil", "/proc/sys/kernel/hostname", "/etc/hosts"]:
            try:
                with open(path, "w") as f:
                    f.write("x")
                written.append(path)
            except OSError:
                pass
        print("written:", written)
        open("/etc/evil", "w")
        """, {"error"}, "Read-only file system"),
    "reading_host_files": ("""
        leaked = []
        for path in [HOST_SECRET, "/proc/1/environ", "/etc/shadow", "/var/run/docker.sock",
                     "/proc/1/root/etc/hostname"]:
            try:
                with open(path, "rb") as f:
                    leaked.append((path, f.read(100)))
            except OSError:
                pass
        print("leaked:", leaked)
        open(HOST_SECRET)
        """, {"error"}, "No such file or directory"),
    "privilege_escalation": ("""
        import ctypes, os, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        status = open("/proc/self/status").read()
        print("CapEff zero:", "CapEff:\\t0000000000000000" in status, "NoNewPrivs:", "NoNewPrivs:\\t1" in status)
        gained = []
        for name, attempt in [
            ("setuid", lambda: os.setuid(0)),
            ("setgid", lambda: os.setgid(0)),
            ("chroot", lambda: os.chroot("/work")),
            ("unshare_user_ns", lambda: libc.unshare(0x10000000) == 0 or (_ for _ in ()).throw(OSError())),
            ("mount", lambda: libc.mount(b"none", b"/work", b"tmpfs", 0, None) == 0 or (_ for _ in ()).throw(OSError())),
            ("su", lambda: subprocess.run(["su", "-c", "id -u"], input=b"", capture_output=True, timeout=5, check=True)),
        ]:
            try:
                attempt()
                gained.append(name)
            except Exception:
                pass
        print("gained:", gained, "uid:", os.getuid())
        os.setuid(0)
        """, {"error"}, "Operation not permitted"),
    "kill_pid_1": ("import os, signal\nos.kill(1, signal.SIGKILL)\n", {"error"}, "Operation not permitted"),
    "kill_every_process": ("import os, signal\nos.kill(-1, signal.SIGKILL)\n", {"sandbox_error"}, ""),
    "megabytes_of_output": ("import sys\nfor _ in range(64):\n    sys.stdout.write('x' * 2**20)\n",
                            {"output_limit"}, ""),
    "megabytes_on_stderr": ("import sys\nsys.stderr.write('e' * 8 * 2**20)\n", {"output_limit"}, ""),
    "output_around_the_runner": ("""
        import os
        with open(f"/proc/{os.getppid()}/fd/1", "w") as runner_stdout:
            runner_stdout.write("x" * 2**20)
        """, {"error"}, "Permission denied"),
    "background_processes": ("""
        import os, subprocess
        subprocess.Popen(["sleep", "1000"], start_new_session=True)
        if os.fork() == 0:  # a double-forked daemon
            os.setsid()
            if os.fork() == 0:
                import time
                time.sleep(1000)
            os._exit(0)
        print("spawned")
        """, {"background_processes"}, ""),
    "stop_the_runner": ("import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n", {"timeout"}, "stopped answering"),
}


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxOptions(pool_size=1, timeout_s=3)) as box:
        yield box


@pytest.fixture(scope="module")
def host_secret(tmp_path_factory):
    path = tmp_path_factory.mktemp("host") / "secret.txt"
    path.write_text("PLAIT-HOST-SECRET")
    return str(path)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_is_contained_and_the_pool_recovers(name, sandbox, engine, host_secret):
    source, reasons, evidence = HOSTILE[name]
    code = f"HOST_SECRET = {host_secret!r}\n" + textwrap.dedent(source)
    timeout = 1 if name == "stop_the_runner" else None
    result = sandbox.execute(code, timeout_s=timeout)

    assert not result.ok
    assert result.reason in reasons, result
    assert result.detail
    if evidence:
        assert any(e in result.stdout + result.stderr + result.detail for e in evidence.split("|")), result
    assert "CONNECTED" not in result.stdout and "RESOLVED" not in result.stdout
    assert "PLAIT-HOST-SECRET" not in result.stdout + result.stderr
    assert "written: []" in result.stdout or name != "writes_outside_work_dir"
    assert "leaked: []" in result.stdout or name != "reading_host_files"
    if name == "privilege_escalation":
        assert "CapEff zero: True NoNewPrivs: True" in result.stdout
        assert "gained: [] uid: 10001" in result.stdout
    if name == "network_egress":
        assert "interfaces: ['lo']" in result.stdout
    if name.startswith("megabytes"):
        assert len(result.stdout) + len(result.stderr) <= 2 * sandbox.options.output_limit_bytes

    after = sandbox.execute("import os\nprint('alive', os.listdir('.'))")
    assert after.ok, after
    assert after.stdout == "alive ['main.py']\n"  # the work dir was wiped
    (container,) = engine.pool_containers(sandbox.pool_id)
    container.reload()
    assert container.status == "running"
    assert engine.sandbox_user_processes(container) == []
    assert not container.diff()  # nothing written to the container's root file system


def test_limits_are_applied_to_the_container(sandbox, engine):
    (container,) = engine.pool_containers(sandbox.pool_id)
    host = container.attrs["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges:true" in host["SecurityOpt"]
    assert host["Memory"] == host["MemorySwap"] == 256 * 2**20
    assert host["PidsLimit"] == 64
    assert host["NanoCpus"] == 10**9
    assert container.attrs["Config"]["User"] == "10000:10000"
    result = sandbox.execute("import os\nprint(os.getuid(), os.getgid())")
    assert result.stdout == "10001 10001\n"


def test_a_program_that_runs_on_after_closing_its_output_is_not_cut_short(sandbox):
    code = "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(0.5)\nraise SystemExit(3)\n"
    result = sandbox.execute(code)
    assert (result.reason, result.exit_code) == ("error", 3)  # it reached its end: not killed
