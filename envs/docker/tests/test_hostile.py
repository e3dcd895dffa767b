"""Hostile programs: each is contained, reported with its reason, and the next execution in the
same pool finds nothing left of it (work dir, IPC objects, memory, processes) and grades a correct
answer with full marks. Runs on the real engine (marker `docker`)."""

from __future__ import annotations

import asyncio
import socket
import textwrap

import pytest

from plait_docker.grading import grade_answer
from plait_docker.sandbox import Sandbox, SandboxOptions
from plait_docker.tasks import python_tasks

pytestmark = pytest.mark.docker


def _egress_target() -> str:
    """A package registry's address (the only outside hosts this machine may contact), resolved
    on the host; the sandbox must not reach it."""
    try:
        return socket.getaddrinfo("pypi.org", 443, socket.AF_INET)[0][4][0]
    except OSError:
        return "pypi.org"


HOSTILE = {
    "network_egress": (
        f"""
        import os, socket
        print("interfaces:", sorted(os.listdir("/sys/class/net")))
        socket.create_connection(({_egress_target()!r}, 443), timeout=3)
        print("CONNECTED")
        """,
        {"error"},
        "unreachable|Name or service not known|Temporary failure",
    ),
    "dns_lookup": (
        """
        import socket
        socket.getaddrinfo("pypi.org", 443)
        print("RESOLVED")
        """,
        {"error"},
        "gaierror",
    ),
    "fork_bomb": (
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """,
        {"pids_limit"},
        "",
    ),
    "memory_bomb": (
        """
        hog = []
        while True:
            hog.append(bytearray(32 * 2**20))
        """,
        {"memory_limit"},
        "",
    ),
    "infinite_loop": ("while True:\n    pass\n", {"timeout"}, ""),
    "disk_fill": (
        """
        with open("fill", "wb") as f:
            while True:
                f.write(b"x" * 2**20)
        """,
        {"disk_limit"},
        "No space left on device",
    ),
    "writes_outside_work_dir": (
        """
        written = []
        for path in ["/etc/evil", "/tmp/evil", "/usr/lib/evil", "/evil", "/root/evil",
                     "/var/tmp/evil", "/dev/shm/evil", "/dev/evil", "/sys/evil",
                     "/proc/sys/kernel/hostname", "/etc/hosts"]:
            try:
                with open(path, "w") as f:
                    f.write("x")
                written.append(path)
            except OSError:
                pass
        print("written:", written)
        open("/etc/evil", "w")
        """,
        {"error"},
        "Read-only file system",
    ),
    "reading_host_files": (
        """
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
        """,
        {"error"},
        "No such file or directory",
    ),
    "privilege_escalation": (
        """
        import ctypes, os, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        status = open("/proc/self/status").read()
        print("CapEff zero:", "CapEff:\\t0000000000000000" in status,
              "NoNewPrivs:", "NoNewPrivs:\\t1" in status)

        def raise_oserror():
            raise OSError()

        gained = []
        for name, attempt in [
            ("setuid", lambda: os.setuid(0)),
            ("setgid", lambda: os.setgid(0)),
            ("chroot", lambda: os.chroot("/work")),
            ("unshare_user_ns", lambda: libc.unshare(0x10000000) == 0 or raise_oserror()),
            ("mount",
             lambda: libc.mount(b"none", b"/work", b"tmpfs", 0, None) == 0 or raise_oserror()),
            ("su", lambda: subprocess.run(["su", "-c", "id -u"], input=b"", capture_output=True,
                                          timeout=5, check=True)),
        ]:
            try:
                attempt()
                gained.append(name)
            except Exception:
                pass
        print("gained:", gained, "uid:", os.getuid())
        os.setuid(0)
        """,
        {"error"},
        "Operation not permitted",
    ),
    "kill_pid_1": (
        "import os, signal\nos.kill(1, signal.SIGKILL)\n",
        {"error"},
        "Operation not permitted",
    ),
    "kill_every_process": (
        "import os, signal\nos.kill(-1, signal.SIGKILL)\n",
        {"error"},
        "Operation not permitted",
    ),
    "megabytes_of_output": (
        "import sys\nfor _ in range(64):\n    sys.stdout.write('x' * 2**20)\n",
        {"output_limit"},
        "",
    ),
    "megabytes_on_stderr": (
        "import sys\nsys.stderr.write('e' * 8 * 2**20)\n",
        {"output_limit"},
        "",
    ),
    "output_around_the_runner": (
        """
        import os
        with open(f"/proc/{os.getppid()}/fd/1", "w") as runner_stdout:
            runner_stdout.write("x" * 2**20)
        """,
        {"error"},
        "Permission denied",
    ),
    "background_processes": (
        """
        import os, subprocess
        subprocess.Popen(["sleep", "1000"], start_new_session=True)
        if os.fork() == 0:  # a double-forked daemon
            os.setsid()
            if os.fork() == 0:
                import time
                time.sleep(1000)
            os._exit(0)
        print("spawned")
        """,
        {"background_processes"},
        "",
    ),
    "stop_the_runner": (
        "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\n",
        {"error"},
        "Operation not permitted",
    ),
    "tamper_with_the_runner": (
        """
        import ctypes, fcntl, os, resource, signal, socket
        runner = os.getppid()
        libc = ctypes.CDLL(None, use_errno=True)
        TGKILL = {"x86_64": 234, "aarch64": 131}[os.uname().machine]
        sock = socket.socket()

        def tgkill():
            if libc.syscall(TGKILL, runner, runner, signal.SIGSTOP) != 0:
                raise OSError(ctypes.get_errno(), "tgkill")

        tampered = []
        for name, attempt in [
            ("prlimit", lambda: resource.prlimit(runner, resource.RLIMIT_NOFILE, (0, 0))),
            ("renice", lambda: os.setpriority(os.PRIO_PROCESS, runner, 19)),
            ("renice_user", lambda: os.setpriority(os.PRIO_USER, os.getuid(), 19)),
            ("sched_idle", lambda: os.sched_setscheduler(runner, os.SCHED_IDLE, os.sched_param(0))),
            ("sigio_owner", lambda: fcntl.fcntl(sock, fcntl.F_SETOWN, runner)),
            ("pidfd_signal",
             lambda: signal.pidfd_send_signal(os.open(f"/proc/{runner}", os.O_RDONLY), 0)),
            ("killpg", lambda: os.killpg(os.getpgid(runner), 0)),
            ("tgkill", tgkill),
        ]:
            try:
                attempt()
                tampered.append(name)
            except OSError:
                pass
        print("tampered:", tampered)
        os.kill(runner, signal.SIGKILL)
        """,
        {"error"},
        "tampered: []",
    ),
    "sysv_ipc_poisoning": (
        """
        # Plant shared memory (and a semaphore set and a message queue), then hand every object
        # over to the other sandbox user with IPC_SET, so that a wipe of this user's objects
        # misses it.
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        libc.shmat.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
        libc.shmdt.argtypes = (ctypes.c_void_p,)
        IPC_CREAT, IPC_SET, IPC_STAT, CHUNK = 0o1000, 1, 2, 16 << 20

        def hand_over(ctl, ipc_id, *before_cmd):
            buf = ctypes.create_string_buffer(512)
            assert ctl(ipc_id, *before_cmd, IPC_STAT, buf) == 0, ctypes.get_errno()
            ctypes.c_uint32.from_buffer(buf, 4).value = 10000  # the owner: PID 1's user
            ctypes.c_uint16.from_buffer(buf, 20).value = 0o666  # readable by every later program
            assert ctl(ipc_id, *before_cmd, IPC_SET, buf) == 0, ctypes.get_errno()

        planted = 0
        while planted < 240 << 20:
            shm = libc.shmget(0, CHUNK, IPC_CREAT | 0o600)
            if shm < 0:
                break
            addr = libc.shmat(shm, None, 0)
            ctypes.memset(addr, 0x5A, CHUNK)  # charged to the container's memory
            libc.shmdt(addr)
            hand_over(libc.shmctl, shm)
            planted += CHUNK
        hand_over(libc.semctl, libc.semget(0, 4, IPC_CREAT | 0o600), 0)
        queue = libc.msgget(0, IPC_CREAT | 0o600)
        message = ctypes.create_string_buffer(b"\\1\\0\\0\\0\\0\\0\\0\\0" + b"secret" * 100)
        libc.msgsnd(queue, message, 600, 0)
        hand_over(libc.msgctl, queue)
        print("planted", planted >> 20, "MiB")
        """,
        {"ok", "memory_limit"},
        "",
    ),
    "deep_directory_tree": (
        """
        import os
        for _ in range(2500):
            os.mkdir("d")
            os.chdir("d")
        open("leaf", "w").write("x")
        for _ in range(500):
            os.chdir("..")
        os.chmod("d", 0)  # and 2,000 levels down, a directory neither readable nor searchable
        print("depth 2500")
        """,
        {"ok"},
        "depth 2500",
    ),
    "inode_exhaustion": (
        """
        count = 0
        try:
            while True:
                open(f"f{count}", "w").close()
                count += 1
        finally:
            print("files:", count)
        """,
        {"disk_limit"},
        "No space left on device",
    ),
    "exec_from_the_work_dir": (
        """
        import os, shutil, subprocess
        shutil.copy("/bin/true", "mytrue")
        os.chmod("mytrue", 0o755)
        subprocess.run(["./mytrue"], check=True)
        print("EXECUTED")
        """,
        {"error"},
        "Permission denied",
    ),
    "io_uring_and_other_kernel_surface": (
        """
        # syscalls that code tasks never need: each must fail with EPERM or ENOSYS (not EBADF,
        # EINVAL or a file descriptor, which would mean the kernel ran it)
        import ctypes, errno, os
        libc = ctypes.CDLL(None, use_errno=True)
        NUMBERS = {
            "x86_64": {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                       "userfaultfd": 323, "memfd_create": 319, "bpf": 321, "keyctl": 250,
                       "perf_event_open": 298, "unshare": 272, "mount": 165},
            "aarch64": {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                        "userfaultfd": 282, "memfd_create": 279, "bpf": 280, "keyctl": 219,
                        "perf_event_open": 241, "unshare": 97, "mount": 40},
        }[os.uname().machine]
        params = ctypes.create_string_buffer(256)
        ARGS = {"io_uring_setup": (8, params), "io_uring_enter": (0, 1, 0, 0, None, 0),
                "io_uring_register": (0, 0, None, 0), "userfaultfd": (1,),
                "memfd_create": (b"x", 0), "bpf": (0, params, 128), "keyctl": (0, -3, 0),
                "perf_event_open": (params, 0, -1, -1, 0), "unshare": (0x10000000,),
                "mount": (b"none", b"/work", b"tmpfs", 0, None)}
        allowed = {}
        for name, number in NUMBERS.items():
            ctypes.set_errno(0)
            result = libc.syscall(number, *ARGS[name])
            error = ctypes.get_errno()
            if result >= 0 or error not in (errno.EPERM, errno.ENOSYS):
                allowed[name] = errno.errorcode.get(error, result)
        print("allowed:", allowed)
        raise OSError(errno.EPERM, "io_uring_setup")
        """,
        {"error"},
        "allowed: {}",
    ),
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


# Run after every hostile program, in the same one-container pool: nothing may carry over.
CLEAN_CHECK = textwrap.dedent("""
    import os
    hog = bytearray(8 << 20)  # memory is not held by anything the last program left
    ipc = {kind: open(f"/proc/sysvipc/{kind}").read().splitlines()[1:]
           for kind in ("shm", "sem", "msg")}
    print("work:", os.listdir("."), oct(os.stat(".").st_mode & 0o7777), os.listxattr("."))
    print("ipc:", ipc, "mqueue:", os.listdir("/dev/mqueue"))
    """)
CLEAN = "work: ['main.py'] 0o700 []\nipc: {'shm': [], 'sem': [], 'msg': []} mqueue: []\n"


def assert_the_pool_is_clean(sandbox, engine) -> None:
    after = sandbox.execute(CLEAN_CHECK)
    assert (after.reason, after.stdout) == ("ok", CLEAN), after
    task = python_tasks().task("plait/1")
    grade = asyncio.run(grade_answer(sandbox, task, task.prompt + task.canonical_solution))
    assert (grade.reward, grade.passed) == (1.0, True), grade
    (container,) = engine.pool_containers(sandbox.pool_id)
    container.reload()
    assert container.status == "running"
    assert engine.sandbox_user_processes(container) == []
    assert not container.diff()  # nothing written to the container's root file system


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_is_contained_and_the_pool_recovers(name, sandbox, engine, host_secret):
    source, reasons, evidence = HOSTILE[name]
    code = f"HOST_SECRET = {host_secret!r}\n" + textwrap.dedent(source)
    result = sandbox.execute(code)

    assert not result.ok or "ok" in reasons
    assert result.reason in reasons, result
    assert result.detail
    if evidence:
        assert any(
            e in result.stdout + result.stderr + result.detail for e in evidence.split("|")
        ), result
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

    assert_the_pool_is_clean(sandbox, engine)


def test_limits_are_applied_to_the_container(sandbox, engine):
    (container,) = engine.pool_containers(sandbox.pool_id)
    host = container.attrs["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges:true" in host["SecurityOpt"]
    assert any(
        opt.startswith("seccomp=") and "io_uring_setup" in opt for opt in host["SecurityOpt"]
    )
    assert {"noexec", "nosuid", "nodev", "nr_inodes=4096", "mode=700"} <= set(
        host["Tmpfs"]["/work"].split(",")
    )
    assert host["Sysctls"]["kernel.shmmax"] == str(64 * 2**20)
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
