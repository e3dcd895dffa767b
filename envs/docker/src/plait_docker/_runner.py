"""The program that runs *inside* a sandbox container, as the sandbox user (stdlib only).

It is not imported on the host: the host passes this file's source to `python3 -c` in every exec,
so the image holds only the OS and Python, and changing this file needs no image rebuild.

    python3 -I -B -c SOURCE run '{"code": ..., "timeout_s": ..., "output_limit_bytes": ...}'
    python3 -I -B -c SOURCE reset

`run` executes the program as a child in its own session with its output captured through pipes
(capped), kills it at the wall-clock deadline, then kills every other process of the sandbox user
(background processes the program left) and wipes the work dir, and prints one JSON report on
stdout. `reset` does only the cleanup; the host runs it when a `run` did not finish normally.
Exit status 0 means the container is clean and can be reused; 3 means processes survived.

The runner makes itself non-dumpable, so the program (same user) can neither ptrace it nor open its
/proc/PID/fd to forge the report; it can still signal it, which the host sees as a failed run.
"""

import contextlib
import ctypes
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time

WORK_DIR = "/work"
MQUEUE_DIR = "/dev/mqueue"  # the one writable place outside the work dir (POSIX message queues)
PROGRAM = WORK_DIR + "/main.py"
KILL_DEADLINE_S = 3.0
# After the program exits, how long to keep reading output that its leftovers may still write.
DRAIN_AFTER_EXIT_S = 0.1
# (file, key) pairs of cgroup event counters, v1 then v2; the first readable one counts.
OOM_COUNTERS = (("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill"),
                ("/sys/fs/cgroup/memory.events", "oom_kill"))
PIDS_COUNTERS = (("/sys/fs/cgroup/pids/pids.events", "max"), ("/sys/fs/cgroup/pids.events", "max"))
PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORK_DIR,
    "TMPDIR": WORK_DIR,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
}
PR_SET_DUMPABLE = 4


def read_counter(candidates):
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


def other_live_processes():
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


def kill_others():
    """SIGKILL every other process of this user (kill(-1) spares only the caller); True when none is left."""
    end = time.monotonic() + KILL_DEADLINE_S
    while True:
        with contextlib.suppress(ProcessLookupError):  # ESRCH: nothing left to signal
            os.kill(-1, signal.SIGKILL)
        if not other_live_processes():
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.005)


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        # a program may have left directories without write or search permission
        for root, dirs, _files in os.walk(path):
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(root, d), 0o700)
        os.chmod(path, 0o700)
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.unlink(path)


def wipe():
    """Empty the work dir and remove this user's message queues and System V IPC objects, so that
    nothing carries over to the next program."""
    uid = os.getuid()
    for directory, owned_only in ((WORK_DIR, False), (MQUEUE_DIR, True)):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            try:
                if owned_only and os.lstat(path).st_uid != uid:
                    continue
                _remove(path)
            except OSError:
                pass
    for kind, flag in (("shm", "-m"), ("msg", "-q"), ("sem", "-s")):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        ids = [row[1] for row in rows if len(row) > 8 and row[7] == str(uid)]  # columns: key id ... uid
        for ipc_id in ids:
            subprocess.run(["ipcrm", flag, ipc_id], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           check=False)


def set_dumpable(flag):
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, flag, 0, 0, 0)


def _program_preexec():
    # Undo the runner's non-dumpable flag (it makes /proc/self root-owned) so that the program can
    # raise its own OOM score: the memory cgroup's OOM killer then picks it, never the runner.
    set_dumpable(1)
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")


def capture(proc, timeout_s, limit):
    """Read the program's stdout/stderr until it exits (or the deadline, or the cap); returns
    (stdout bytes, stderr bytes, reason or None)."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    outputs = {out_fd: bytearray(), err_fd: bytearray()}
    selector = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
        selector.register(stream.fileno(), selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    exited_at = None
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                return bytes(outputs[out_fd]), bytes(outputs[err_fd]), "timeout"
            if exited_at is not None and (not selector.get_map() or now - exited_at > DRAIN_AFTER_EXIT_S):
                return bytes(outputs[out_fd]), bytes(outputs[err_fd]), None
            wait = min(deadline - now, 0.05)
            if selector.get_map():
                events = selector.select(wait)
            else:  # the program closed both pipes but runs on
                time.sleep(wait)
                events = []
            for key, _ in events:
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
        for stream in (proc.stdout, proc.stderr):
            stream.close()


def run(spec):
    with open(PROGRAM, "w", encoding="utf-8") as f:
        f.write(spec["code"])
    oom_before, pids_before = read_counter(OOM_COUNTERS), read_counter(PIDS_COUNTERS)
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-B", PROGRAM], cwd=WORK_DIR, env=PROGRAM_ENV, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_program_preexec,
    )
    stdout, stderr, reason = capture(proc, spec["timeout_s"], spec["output_limit_bytes"])
    duration = time.monotonic() - started
    if proc.poll() is None:
        for target in (-proc.pid, proc.pid):  # its process group, and itself should it have left the group
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGKILL)
    exit_code = proc.wait()
    leftovers = other_live_processes()
    cleared = kill_others()
    work_dir_full = os.statvfs(WORK_DIR).f_bavail == 0
    wipe()
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
    }
    sys.stdout.write(json.dumps(report))
    sys.stdout.flush()
    return 0 if cleared else 3


def reset():
    cleared = kill_others()
    wipe()
    sys.stdout.write(json.dumps({"cleared": cleared}))
    sys.stdout.flush()
    return 0 if cleared else 3


def main(argv):
    set_dumpable(0)
    if argv[0] == "run":
        return run(json.loads(argv[1]))
    if argv[0] == "reset":
        return reset()
    sys.stderr.write(f"unknown runner mode {argv[0]!r}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
