"""The seccomp profile of sandbox containers: an allow list of the system calls Python programs need.

Docker's default profile allows about 370 system calls, io_uring among them. Code tasks need far
fewer, so every sandbox container gets this profile instead (it applies to PID 1 and to every exec):

- `ALLOWED`: the calls ordinary Python programs make (the interpreter, threads, subprocess, fork,
  sockets on the loopback interface, files in the work dir, timers, signals), grouped by purpose.
  `clone` is allowed only without namespace flags, `socket` only for the families in
  `SOCKET_FAMILIES`.
- `DENIED`: calls that a program might try and that code tasks never need, each with its reason;
  they fail with EPERM.
- Anything else fails with ENOSYS, as if the kernel did not have the call, so that glibc and Python
  take their fallbacks (`clone3` is the case that matters today: glibc then uses `clone`).

The profile holds names for x86_64 and aarch64; names the running architecture does not have are
ignored by the engine. It lists no architecture, so only the native ABI passes: a call through
another one (i386 or x32 on x86_64) kills the process.
"""

from __future__ import annotations

import errno
import json
from typing import Any

ALLOWED: dict[str, tuple[str, ...]] = {
    "processes and threads": (
        "arch_prctl", "execve", "execveat", "exit", "exit_group", "fork", "vfork", "wait4", "waitid",
        "set_tid_address", "set_robust_list", "get_robust_list", "rseq", "futex", "futex_waitv",
        "membarrier", "restart_syscall", "prctl", "capget", "getpid", "getppid", "gettid", "getpgid",
        "getpgrp", "getsid", "setpgid", "setsid", "getpriority", "setpriority", "sched_yield",
        "sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_setparam",
        "sched_getscheduler", "sched_setscheduler", "sched_getattr", "sched_setattr",
        "sched_get_priority_max", "sched_get_priority_min", "sched_rr_get_interval",
        "getrlimit", "setrlimit", "prlimit64", "getrusage", "times", "uname", "sysinfo", "getcpu",
        "getrandom",
    ),
    "user and group ids (changing them fails without capabilities)": (
        "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups", "setuid",
        "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid",
    ),
    "signals": (
        "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigsuspend", "rt_sigpending",
        "rt_sigtimedwait", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "sigaltstack", "signalfd",
        "signalfd4", "kill", "tkill", "tgkill", "pause", "alarm",
    ),
    "time and timers": (
        "clock_gettime", "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday", "time",
        "getitimer", "setitimer", "timer_create", "timer_settime", "timer_gettime",
        "timer_getoverrun", "timer_delete", "timerfd_create", "timerfd_settime", "timerfd_gettime",
    ),
    "memory": (
        "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "mincore", "msync",
    ),
    "files and directories": (
        "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2",
        "pwritev2", "open", "openat", "openat2", "creat", "close", "close_range", "lseek", "dup",
        "dup2", "dup3", "fcntl", "flock", "ioctl", "pipe", "pipe2", "stat", "fstat", "lstat",
        "newfstatat", "statx", "statfs", "fstatfs", "access", "faccessat", "faccessat2", "readlink",
        "readlinkat", "getdents", "getdents64", "getcwd", "chdir", "fchdir", "mkdir", "mkdirat",
        "rmdir", "unlink", "unlinkat", "rename", "renameat", "renameat2", "link", "linkat",
        "symlink", "symlinkat", "mknod", "mknodat", "chmod", "fchmod", "fchmodat", "chown",
        "fchown", "fchownat", "lchown", "umask", "truncate", "ftruncate", "fallocate", "fsync",
        "fdatasync", "sync", "syncfs", "sync_file_range", "fadvise64", "readahead", "utime",
        "utimes", "utimensat", "futimesat", "getxattr", "lgetxattr", "fgetxattr", "listxattr",
        "llistxattr", "flistxattr", "copy_file_range", "sendfile", "splice", "tee",
        "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch",
    ),
    "waiting for events": (
        "select", "pselect6", "poll", "ppoll", "epoll_create", "epoll_create1", "epoll_ctl",
        "epoll_wait", "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2",
    ),
    "sockets (the container has only the loopback interface)": (
        "socketpair", "bind", "listen", "accept", "accept4", "connect", "getsockname", "getpeername",
        "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg", "shutdown", "setsockopt",
        "getsockopt",
    ),
    "IPC (private to the container; the runner removes every object after each execution)": (
        "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl", "msgget",
        "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive",
        "mq_notify", "mq_getsetattr",
    ),
}

# AF_UNIX, AF_INET, AF_INET6, AF_NETLINK (if_nameindex and friends); no packet, crypto, vsock, ...
SOCKET_FAMILIES = (1, 2, 10, 16)
# clone with any of CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET is refused.
CLONE_NAMESPACE_FLAGS = 0x7E020000

DENIED: dict[str, tuple[str, ...]] = {
    "io_uring: a large, often exploited kernel interface that Python does not use": (
        "io_uring_setup", "io_uring_enter", "io_uring_register",
    ),
    "Linux AIO, unused by Python": (
        "io_setup", "io_destroy", "io_submit", "io_cancel", "io_getevents", "io_pgetevents",
    ),
    "kernel interfaces behind many exploits (bpf, perf, userfaultfd, keyrings)": (
        "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    ),
    "executable memory files: they would run code that the noexec work dir refuses": (
        "memfd_create", "memfd_secret",
    ),
    "inspecting or steering other processes": (
        "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "process_mrelease",
        "kcmp", "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "ioprio_set", "migrate_pages",
        "move_pages", "mbind", "set_mempolicy", "set_mempolicy_home_node",
    ),
    "namespaces, mounts and the root (need capabilities the container does not have)": (
        "clone3", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "move_mount",
        "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "quotactl",
        "quotactl_fd", "name_to_handle_at", "open_by_handle_at", "fanotify_init", "fanotify_mark",
    ),
    "the machine: modules, clock, reboot, swap, accounting, host names, I/O ports": (
        "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot",
        "swapon", "swapoff", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
        "sethostname", "setdomainname", "iopl", "ioperm", "syslog", "vhangup", "lookup_dcookie",
    ),
    "changing extended attributes (they could carry data from one execution to the next)": (
        "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    ),
    "rarely used and not needed: execution domains, locked memory, memory keys, self-sandboxing": (
        "personality", "modify_ldt", "mlock", "mlock2", "mlockall", "munlock", "munlockall",
        "pkey_alloc", "pkey_free", "pkey_mprotect", "remap_file_pages", "vmsplice", "seccomp",
        "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
    ),
}


def allowed_names() -> list[str]:
    return sorted({name for names in ALLOWED.values() for name in names})


def denied_names() -> list[str]:
    return sorted({name for names in DENIED.values() for name in names})


def profile() -> dict[str, Any]:
    """The profile in the engine's JSON format (what `--security-opt seccomp=FILE` reads)."""
    rules: list[dict[str, Any]] = [
        {"names": allowed_names(), "action": "SCMP_ACT_ALLOW"},
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": CLONE_NAMESPACE_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]},
        *({"names": ["socket"], "action": "SCMP_ACT_ALLOW",
           "args": [{"index": 0, "value": family, "valueTwo": 0, "op": "SCMP_CMP_EQ"}]} for family in SOCKET_FAMILIES),
        {"names": [n for n in denied_names() if n != "clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
        # glibc creates threads with clone3 and falls back to clone only on ENOSYS
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
    ]
    return {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": errno.ENOSYS, "syscalls": rules}


def security_opt() -> str:
    """The `security_opt` entry that applies the profile (the engine takes the JSON inline)."""
    return "seccomp=" + json.dumps(profile(), separators=(",", ":"))
