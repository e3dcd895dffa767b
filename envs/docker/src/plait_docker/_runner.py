"""The program that runs *inside* a sandbox container, as the sandbox user (stdlib only).

It is not imported on the host: the host passes this file's source to `python3 -c` in every exec,
so the image holds only the OS and Python, and changing this file needs no image rebuild.

    python3 -I -B -c SOURCE run      < JOB
    python3 -I -B -c SOURCE reset

    JOB = '{"code": ..., "stdin": ..., "timeout_s": ..., "output_limit_bytes": ...}'

`run` reads its job from stdin (so that the program, hidden tests included, never appears in a
process list), executes the program as a child in its own session with its stdin fed and its
output captured through pipes (capped), kills it at the wall-clock deadline, then kills every
other process of the sandbox user (background processes the program left), wipes everything that
could carry over to the next program (the work dir, POSIX message queues, System V IPC objects,
whoever owns them) and prints one JSON report on stdout. `reset` does only the cleanup; the host
runs it when a `run` did not finish normally. Exit status 0 means the container is clean and can
be reused; 3 means something survived the cleanup (the host then replaces the container).

While it works, the runner writes a NUL byte to stderr every HEARTBEAT_S, so that the host can
tell a runner that stopped (or a frozen container) from one that is busy.

The program runs as the same user as the runner, so the runner protects itself twice: it makes
itself non-dumpable (no ptrace, no writing through its /proc/PID/fd), and it gives the program a
seccomp filter (`guard_filter`) that refuses every system call aimed at the runner: signals,
resource limits, priorities and scheduling, and I/O-owner signals. What happens to the runner is
therefore never the program's doing, and the host reports it as a fault of the sandbox.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping

# Every execution starts this program: it imports `typing` only for the type checker.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

WORK_DIR = "/work"
WORK_DIR_MODE = 0o700
MQUEUE_DIR = "/dev/mqueue"  # the one writable place outside the work dir (POSIX message queues)
PROGRAM = WORK_DIR + "/main.py"
KILL_DEADLINE_S = 3.0
HEARTBEAT_S = 0.25
# After the program exits, how long to keep reading output that its leftovers may still write.
DRAIN_AFTER_EXIT_S = 0.1
STDIN_CHUNK = 65536
# (file, key) pairs of cgroup event counters, v1 then v2; the first readable one counts.
OOM_COUNTERS = (
    ("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill"),
    ("/sys/fs/cgroup/memory.events", "oom_kill"),
)
PIDS_COUNTERS = (("/sys/fs/cgroup/pids/pids.events", "max"), ("/sys/fs/cgroup/pids.events", "max"))
PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORK_DIR,
    "TMPDIR": WORK_DIR,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
}
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 4, 38, 22, 2
IPC_RMID = 0

libc = ctypes.CDLL(None, use_errno=True)
_last_beat = 0.0


def beat() -> None:
    """Tell the host this runner is alive (at most every HEARTBEAT_S)."""
    global _last_beat
    now = time.monotonic()
    if now - _last_beat >= HEARTBEAT_S:
        _last_beat = now
        with contextlib.suppress(OSError):
            os.write(2, b"\0")


# ------------------------------------------------------------------------------------------------
# The program's seccomp guard: nothing it does can reach the runner
# ------------------------------------------------------------------------------------------------

# seccomp_data: nr at 0, arch at 4, args[i] at 16 + 8 * i (the low 32 bits first: little endian)
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000
SYSCALL_NUMBERS = {  # name: (x86_64, aarch64)
    "kill": (62, 129),
    "tkill": (200, 130),
    "tgkill": (234, 131),
    "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240),
    "prlimit64": (302, 261),
    "setpriority": (141, 140),
    "sched_setaffinity": (203, 122),
    "sched_setparam": (142, 118),
    "sched_setscheduler": (144, 119),
    "sched_setattr": (314, 274),
    "fcntl": (72, 25),
    "ioctl": (16, 29),
}
PRIO_PGRP, PRIO_USER = 1, 2
F_SETOWN, F_SETOWN_EX = 8, 15
FIOSETOWN, SIOCSPGRP = 0x8901, 0x8902
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_EPERM = (
    0x7FFF0000,
    0x80000000,
    0x00050000 | 1,
)


def guard_rules(runner_ids: Iterable[int]) -> list[tuple[str, int, set[int]]]:
    """(syscall, argument index, refused values): the calls that could reach the runner, whose
    process (and process group) ids are `runner_ids`. Values are compared on their low 32 bits,
    as the kernel reads a pid_t or an int."""
    # 0 means the caller itself (or its process group) and stays allowed; -1 means every process
    targets = {i & 0xFFFFFFFF for pid in runner_ids if pid > 0 for i in (pid, -pid)} | {0xFFFFFFFF}
    rules = [
        (name, 0, targets)
        for name in (
            "kill",
            "tkill",
            "tgkill",
            "rt_sigqueueinfo",
            "rt_tgsigqueueinfo",
            "prlimit64",
            "sched_setaffinity",
            "sched_setparam",
            "sched_setscheduler",
            "sched_setattr",
        )
    ]
    rules += [
        ("tgkill", 1, targets),
        ("rt_tgsigqueueinfo", 1, targets),
        ("setpriority", 0, {PRIO_PGRP, PRIO_USER}),
        ("setpriority", 1, targets),
        ("fcntl", 1, {F_SETOWN, F_SETOWN_EX}),  # then SIGIO (or any F_SETSIG) to the owner
        ("ioctl", 1, {FIOSETOWN, SIOCSPGRP}),
    ]
    return rules


def guard_filter(runner_ids: Iterable[int], machine: str | None = None) -> bytes:
    """The seccomp-BPF program (bytes of struct sock_filter) that refuses `guard_rules` with
    EPERM."""
    machine = machine or os.uname().machine
    column = {"x86_64": 0, "aarch64": 1}[machine]  # another architecture: no guard, no execution

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)

    program = [
        op(BPF_LD_W_ABS, 4),
        op(BPF_JEQ_K, AUDIT_ARCH[machine], 1, 0),
        op(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        op(BPF_LD_W_ABS, 0),
    ]
    if machine == "x86_64":  # the x32 ABI's numbers would slip past the checks below
        program += [op(BPF_JGE_K, X32_SYSCALL_BIT, 0, 1), op(BPF_RET_K, SECCOMP_RET_EPERM)]
    by_syscall: dict[str, list[tuple[int, list[int]]]] = {}
    for name, index, values in guard_rules(runner_ids):
        by_syscall.setdefault(name, []).append((index, sorted(values)))
    for name, checks in by_syscall.items():
        block = []  # entered with the syscall number loaded; ends with "allow", then "refuse"
        for index, refused in checks:
            block.append((BPF_LD_W_ABS, 16 + 8 * index))
            block += [(BPF_JEQ_K, value) for value in refused]
        # another syscall jumps over the block, "allow" and "refuse"
        program.append(op(BPF_JEQ_K, SYSCALL_NUMBERS[name][column], 0, len(block) + 2))
        for position, (code, k) in enumerate(block):
            # a match jumps over the rest of the block and "allow", to "refuse"
            program.append(
                op(code, k, len(block) - position, 0) if code == BPF_JEQ_K else op(code, k)
            )
        program += [op(BPF_RET_K, SECCOMP_RET_ALLOW), op(BPF_RET_K, SECCOMP_RET_EPERM)]
    program.append(op(BPF_RET_K, SECCOMP_RET_ALLOW))
    return b"".join(program)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def program_preexec(guard: SockFprog) -> None:
    """What the child does between fork and exec (`guard`: a SockFprog built before the fork)."""
    # Undo the runner's non-dumpable flag (it makes /proc/self root-owned) so that the program can
    # raise its own OOM score: the memory cgroup's OOM killer then picks it, never the runner.
    set_dumpable(1)
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    if (
        libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
        or libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(guard), 0, 0) != 0
    ):
        raise OSError(ctypes.get_errno(), "could not install the program's seccomp guard")


def set_dumpable(flag: int) -> None:
    libc.prctl(PR_SET_DUMPABLE, flag, 0, 0, 0)


# ------------------------------------------------------------------------------------------------
# Cleanup
# ------------------------------------------------------------------------------------------------


def read_counter(candidates: Iterable[tuple[str, str]]) -> int | None:
    for path, key in candidates:
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        return int(value)
        except OSError:
            continue
    return None


def other_live_processes() -> list[int]:
    """PIDs of live (non-zombie) processes of this user, other than this one."""
    me, uid = os.getpid(), os.getuid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # exited meanwhile
        if int(status["Uid"].split()[0]) == uid and not status["State"].strip().startswith("Z"):
            found.append(int(entry))
    return found


def kill_others() -> bool:
    """SIGKILL every other process of this user (kill(-1) spares only the caller); True when none
    is left."""
    end = time.monotonic() + KILL_DEADLINE_S
    while True:
        beat()
        with contextlib.suppress(ProcessLookupError):  # ESRCH: nothing left to signal
            os.kill(-1, signal.SIGKILL)
        if not other_live_processes():
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.005)


def empty_directory(top: str) -> None:
    """Remove everything inside `top`, however deep and whatever its permissions, without recursion
    and without holding a descriptor per level: walk down with chdir, come back up with ".."."""
    os.chdir(top)
    entered = []  # the directories walked into below top
    try:
        while True:
            beat()
            subdir = None
            for name in os.listdir(b"."):
                if os.path.isdir(name) and not os.path.islink(name):
                    subdir = name
                    break
                os.unlink(name)
            if subdir is not None:
                os.chmod(subdir, 0o700)  # a program may have left it unreadable or unsearchable
                os.chdir(subdir)
                entered.append(subdir)
            elif entered:
                os.chdir("..")
                os.rmdir(entered.pop())
            else:
                return
    finally:
        os.chdir("/")


def ipc_ids(kind: str) -> list[int]:
    try:
        with open(f"/proc/sysvipc/{kind}") as f:
            return [int(line.split()[1]) for line in f.readlines()[1:] if line.strip()]
    except OSError:
        return []


def remove_ipc_objects() -> None:
    """Remove every System V IPC object of the container's (private) IPC namespace. Its owner may
    have been handed to another user with IPC_SET, but its creator can only have been the sandbox
    user, and the creator may always remove it."""
    removers = {
        "shm": lambda i: libc.shmctl(i, IPC_RMID, None),
        "msg": lambda i: libc.msgctl(i, IPC_RMID, None),
        "sem": lambda i: libc.semctl(i, 0, IPC_RMID),
    }
    for kind, remove in removers.items():
        for ipc_id in ipc_ids(kind):
            remove(ipc_id)


def wipe() -> list[str]:
    """Remove everything that could carry over to the next program: the work dir's contents (and
    its mode, times and extended attributes), the POSIX message queues and the System V IPC objects.
    Returns what is left (nothing when clean)."""
    os.chmod(WORK_DIR, WORK_DIR_MODE)
    with contextlib.suppress(OSError):  # no extended attributes on this file system
        for attribute in os.listxattr(WORK_DIR):
            os.removexattr(WORK_DIR, attribute)
    empty_directory(WORK_DIR)
    os.utime(WORK_DIR, (0, 0))
    for name in os.listdir(MQUEUE_DIR):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(MQUEUE_DIR, name))
    remove_ipc_objects()
    left = [f"{WORK_DIR}/{name}" for name in os.listdir(WORK_DIR)]
    left += [f"{MQUEUE_DIR}/{name}" for name in os.listdir(MQUEUE_DIR)]
    left += [
        f"System V {kind} {ipc_id}" for kind in ("shm", "msg", "sem") for ipc_id in ipc_ids(kind)
    ]
    return left


def cleanup() -> tuple[bool, list[str]]:
    """kill_others, then wipe; (clean, what survived)."""
    survivors = []
    if not kill_others():
        survivors.append("processes of the sandbox user")
    try:
        survivors += wipe()
    except Exception as exc:  # the report must still go out; the host replaces the container
        survivors.append(f"the wipe failed: {type(exc).__name__}: {exc}")
    return not survivors, survivors


# ------------------------------------------------------------------------------------------------
# One execution
# ------------------------------------------------------------------------------------------------


def capture(
    proc: subprocess.Popen[bytes], stdin_data: bytes, timeout_s: float, limit: int
) -> tuple[bytes, bytes, str | None]:
    """Feed the program's stdin and read its stdout/stderr until it exits (or the deadline, or the
    cap); returns (stdout bytes, stderr bytes, reason or None)."""
    out_pipe, err_pipe, in_pipe = proc.stdout, proc.stderr, proc.stdin
    if out_pipe is None or err_pipe is None:
        raise ValueError("capture reads the program's stdout and stderr through pipes")
    out_fd, err_fd = out_pipe.fileno(), err_pipe.fileno()
    outputs = {out_fd: bytearray(), err_fd: bytearray()}
    selector = selectors.DefaultSelector()
    for fd in (out_fd, err_fd):
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    in_fd, fed = None, 0
    if in_pipe is not None:
        in_fd = in_pipe.fileno()
        os.set_blocking(in_fd, False)
        selector.register(in_fd, selectors.EVENT_WRITE)
    deadline = time.monotonic() + timeout_s
    exited_at = None
    try:
        while True:
            beat()
            now = time.monotonic()
            if now >= deadline:
                return bytes(outputs[out_fd]), bytes(outputs[err_fd]), "timeout"
            reading = [fd for fd in selector.get_map() if fd != in_fd]
            if exited_at is not None and (not reading or now - exited_at > DRAIN_AFTER_EXIT_S):
                return bytes(outputs[out_fd]), bytes(outputs[err_fd]), None
            wait = min(deadline - now, 0.05)
            if selector.get_map():
                events = selector.select(wait)
            else:  # the program closed both pipes but runs on
                time.sleep(wait)
                events = []
            for key, _ in events:
                if in_pipe is not None and key.fd == in_fd:
                    try:
                        fed += os.write(in_fd, stdin_data[fed : fed + STDIN_CHUNK])
                    except BlockingIOError:
                        continue
                    except OSError:  # the program closed its stdin (EPIPE): it has read enough
                        fed = len(stdin_data)
                    if fed >= len(stdin_data):
                        selector.unregister(in_fd)
                        in_pipe.close()
                    continue
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = outputs[key.fd]
                room = limit - len(buffer)
                buffer += chunk[:room]
                if len(chunk) > room:
                    return bytes(outputs[out_fd]), bytes(outputs[err_fd]), "output_limit"
            if exited_at is None and proc.poll() is not None:
                exited_at = time.monotonic()
    finally:
        selector.close()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


def wait_for(proc: subprocess.Popen[bytes]) -> int:
    """The program's exit status, waiting (with heartbeats) at most KILL_DEADLINE_S; a program that
    does not die of SIGKILL in that time is taken as killed by it (cleanup reports it as a
    survivor)."""
    end = time.monotonic() + KILL_DEADLINE_S
    while time.monotonic() < end:
        beat()
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout=0.1)
    return -signal.SIGKILL


def run(spec: Mapping[str, Any]) -> int:
    with open(PROGRAM, "w", encoding="utf-8") as f:
        f.write(spec["code"])
    stdin_data = spec.get("stdin", "").encode("utf-8")
    instructions = guard_filter([os.getpid(), os.getpgrp()])
    guard = SockFprog(len(instructions) // 8, instructions)
    oom_before, pids_before = read_counter(OOM_COUNTERS), read_counter(PIDS_COUNTERS)
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-B", PROGRAM],
        cwd=WORK_DIR,
        env=PROGRAM_ENV,
        stdin=subprocess.PIPE if stdin_data else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: program_preexec(guard),
    )
    stdout, stderr, reason = capture(
        proc, stdin_data, spec["timeout_s"], spec["output_limit_bytes"]
    )
    duration = time.monotonic() - started
    if proc.poll() is None:
        # its process group, and itself should it have left the group
        for target in (-proc.pid, proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGKILL)
    exit_code = wait_for(proc)
    leftovers = other_live_processes()
    work_dir = os.statvfs(WORK_DIR)
    work_dir_full = work_dir.f_bavail == 0 or work_dir.f_favail == 0  # blocks or inodes
    cleared, survivors = cleanup()
    oom_after, pids_after = read_counter(OOM_COUNTERS), read_counter(PIDS_COUNTERS)
    limits_hit = []
    if oom_before is not None and oom_after is not None and oom_after > oom_before:
        limits_hit.append("memory_limit")
    if pids_before is not None and pids_after is not None and pids_after > pids_before:
        limits_hit.append("pids_limit")
    if work_dir_full:
        limits_hit.append("disk_limit")
    if reason is None or reason == "timeout":
        # a resource limit explains a timeout or a crash better than the symptom does
        if limits_hit:
            reason = limits_hit[0]
        elif reason is None and leftovers:
            reason = "background_processes"
        elif reason is None:
            reason = "ok" if exit_code == 0 else ("error" if exit_code > 0 else "signal")
    report = {
        "reason": reason,
        "exit_code": exit_code,
        "stdout": stdout.decode("utf-8", "replace"),
        "stderr": stderr.decode("utf-8", "replace"),
        "duration_s": round(duration, 4),
        "leftover_processes": len(leftovers),
        "limits_hit": limits_hit,
        "cleared": cleared,
        "survivors": survivors,
    }
    sys.stdout.write(json.dumps(report))
    sys.stdout.flush()
    return 0 if cleared else 3


def reset() -> int:
    cleared, survivors = cleanup()
    sys.stdout.write(json.dumps({"cleared": cleared, "survivors": survivors}))
    sys.stdout.flush()
    return 0 if cleared else 3


def main(argv: list[str]) -> int:
    set_dumpable(0)
    beat()
    if argv[0] == "run":
        return run(json.loads(sys.stdin.buffer.read()))
    if argv[0] == "reset":
        return reset()
    sys.stderr.write(f"unknown runner mode {argv[0]!r}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
