"""Pieces of the in-container runner and the seccomp profile, checked on the host (no engine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from plait_docker import seccomp

RUNNER = os.path.join(os.path.dirname(seccomp.__file__), "_runner.py")


def run_with_runner(body: str) -> subprocess.CompletedProcess:
    """`body` in a fresh interpreter with the runner's functions loaded (they chdir and install
    seccomp filters, which must not happen to the test process)."""
    prelude = f"import runpy\nglobals().update(runpy.run_path({RUNNER!r}))\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_seccomp_profile_denies_io_uring_and_lists_allow_and_deny_apart():
    allowed, denied = set(seccomp.allowed_names()), set(seccomp.denied_names())
    assert not allowed & denied
    assert {
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "bpf",
        "userfaultfd",
        "memfd_create",
        "ptrace",
        "unshare",
        "mount",
        "keyctl",
        "pidfd_send_signal",
    } <= denied
    assert {
        "read",
        "write",
        "execve",
        "futex",
        "wait4",
        "socketpair",
        "mmap",
        "prlimit64",
    } <= allowed
    profile = seccomp.profile()
    assert (profile["defaultAction"], profile["defaultErrnoRet"]) == (
        "SCMP_ACT_ERRNO",
        38,
    )  # ENOSYS
    rules = {tuple(rule["names"]): rule for rule in profile["syscalls"]}
    assert rules[("clone3",)]["errnoRet"] == 38  # glibc falls back to clone
    assert rules[("clone",)]["args"][0]["op"] == "SCMP_CMP_MASKED_EQ"
    for rule in profile["syscalls"]:
        if rule["action"] == "SCMP_ACT_ALLOW":
            assert not set(rule["names"]) & denied
    assert json.loads(seccomp.security_opt().removeprefix("seccomp=")) == profile


@pytest.mark.skipif(
    os.uname().machine not in ("x86_64", "aarch64"), reason="the guard knows x86_64 and aarch64"
)
def test_the_programs_guard_refuses_every_call_aimed_at_the_runner():
    # the test's interpreter plays the runner; its child installs the guard, as a program does
    proc = run_with_runner("""
        import fcntl, json, os, resource, socket
        runner = os.getpid()
        instructions = guard_filter([runner, os.getpgrp()])
        guard = SockFprog(len(instructions) // 8, instructions)
        tgkill = SYSCALL_NUMBERS["tgkill"][0 if os.uname().machine == "x86_64" else 1]

        def raw_tgkill(tgid, tid):
            if libc.syscall(tgkill, tgid, tid, 0) != 0:
                raise OSError(ctypes.get_errno(), "tgkill")

        read_end, write_end = os.pipe()
        if os.fork() == 0:
            program_preexec(guard)
            sock = socket.socket()
            outcomes = {}
            for name, attempt in [
                ("kill", lambda: os.kill(runner, 0)),
                ("kill_every_process", lambda: os.kill(-1, 0)),
                ("killpg", lambda: os.killpg(os.getpgid(runner), 0)),
                ("tgkill", lambda: raw_tgkill(runner, runner)),
                ("prlimit", lambda: resource.prlimit(runner, resource.RLIMIT_NOFILE)),
                ("renice", lambda: os.setpriority(os.PRIO_PROCESS, runner, 0)),
                ("renice_user", lambda: os.setpriority(os.PRIO_USER, os.getuid(), 0)),
                ("sched", lambda: os.sched_setaffinity(runner, os.sched_getaffinity(runner))),
                ("sigio_owner", lambda: fcntl.fcntl(sock, fcntl.F_SETOWN, runner)),
                ("own_limits",
                 lambda: resource.setrlimit(resource.RLIMIT_CORE,
                                            resource.getrlimit(resource.RLIMIT_CORE))),
                ("own_group", lambda: os.kill(0, 0)),
                ("itself", lambda: os.kill(os.getpid(), 0)),
                ("own_thread", lambda: raw_tgkill(os.getpid(), os.getpid())),
                ("own_priority", lambda: os.setpriority(os.PRIO_PROCESS, 0, 1)),
                ("own_socket_owner", lambda: fcntl.fcntl(sock, fcntl.F_GETOWN)),
            ]:
                try:
                    attempt()
                    outcomes[name] = "allowed"
                except OSError as exc:
                    outcomes[name] = os.strerror(exc.errno)
            os.write(write_end, json.dumps(outcomes).encode())
            os._exit(0)
        os.wait()
        print(os.read(read_end, 65536).decode())
        """)
    assert proc.returncode == 0, proc.stderr
    outcomes = json.loads(proc.stdout)
    refused = {name for name, outcome in outcomes.items() if outcome == "Operation not permitted"}
    assert refused == {
        "kill",
        "kill_every_process",
        "killpg",
        "tgkill",
        "prlimit",
        "renice",
        "renice_user",
        "sched",
        "sigio_owner",
    }, outcomes
    assert set(outcomes) - refused == {
        "own_limits",
        "own_group",
        "itself",
        "own_thread",
        "own_priority",
        "own_socket_owner",
    }
    assert {outcomes[name] for name in set(outcomes) - refused} == {"allowed"}


def test_a_deep_tree_with_locked_directories_is_emptied_without_recursion(tmp_path):
    top, outside = tmp_path / "work", tmp_path / "outside"
    top.mkdir()
    outside.mkdir()
    (outside / "canary").write_text("must survive")
    proc = run_with_runner(f"""
        import os
        os.chdir({str(top)!r})
        for _ in range(2500):
            os.mkdir("d")
            os.chdir("d")
        open("leaf", "w").close()
        os.symlink({str(outside)!r}, "link")  # followed, it would empty another directory
        os.chdir("..")
        os.chmod("d", 0)
        os.chdir({str(top)!r})
        os.chmod("d", 0o100)
        empty_directory({str(top)!r})
        print(os.listdir({str(top)!r}))
        """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == "[]\n"
    assert (outside / "canary").read_text() == "must survive"
