"""Run untrusted Python programs inside Docker containers, from a pool of warm containers.

Every container is locked down: no network, a read-only root with a small noexec tmpfs work dir,
memory (without swap), CPU and process limits, small System V IPC limits, PID 1 and the program
under two different non-root users, all capabilities dropped, no-new-privileges, and plait's own
seccomp profile (`seccomp.py`). Each execution is one `docker exec` of the in-container runner
(`_runner.py`), which reads its job from stdin, enforces the wall-clock timeout and the output cap,
kills whatever the program left behind and wipes everything that could carry over, so the
container goes back to the pool clean. The program cannot reach the runner (its seccomp guard), so
a runner that stops answering, or a container that is paused or dies, is a fault of the sandbox:
the host notices it from the runner's heartbeat within HEARTBEAT_LOSS_S, reports `sandbox_error`
(`ExecutionResult.engine_fault`), and resets the container, or replaces it.

Everything created carries labels; `janitor` removes containers whose owning process is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import queue
import socket
import threading
import time
import uuid
import weakref
from importlib import resources
from typing import Any, Literal

import attrs
import docker
import docker.errors
import docker.types
import docker.utils.socket
import requests
import structlog

from plait.api import EngineError, positive
from plait_docker.engine import (
    LABEL_OWNER_HOST,
    LABEL_OWNER_PID,
    LABEL_POOL,
    LABEL_SANDBOX,
    connect,
)
from plait_docker.image import DEFAULT_RECIPE, require_image
from plait_docker.seccomp import security_opt as seccomp_security_opt

log = structlog.get_logger("plait_docker.sandbox")

Reason = Literal[
    "ok",  # exit status 0, nothing left behind
    "error",  # non-zero exit status (an uncaught exception, sys.exit(1), ...)
    "signal",  # the program died from a signal it did not get from the sandbox
    "timeout",  # wall-clock limit
    "memory_limit",  # the memory cgroup's OOM killer struck
    "pids_limit",  # a fork or thread creation hit the process limit
    "disk_limit",  # the work dir filled up
    "output_limit",  # more stdout/stderr than the cap
    "background_processes",  # processes outlived the program (they were killed)
    "program_too_large",  # the program (or its stdin) is larger than allowed
    "cancelled",  # the caller cancelled the execution
    "sandbox_error",  # the sandbox failed, not the program (see ExecutionResult.engine_fault)
]

REASON_DETAILS: dict[str, str] = {
    "ok": "the program ran to completion",
    "error": "the program exited with a non-zero status",
    "signal": "the program was killed by a signal",
    "timeout": "the program exceeded its wall-clock time limit and was killed",
    "memory_limit": "the program exceeded the memory limit and was killed",
    "pids_limit": "the program tried to create more processes or threads than allowed",
    "disk_limit": "the program filled the work directory",
    "output_limit": "the program wrote more output than allowed and was killed",
    "background_processes": "the program left processes running after it exited; they were killed",
    "program_too_large": "the program is too large to run",
    "cancelled": "the execution was cancelled",
    "sandbox_error": "the sandbox failed to run the program",
}

RUNNER_SOURCE = resources.files("plait_docker").joinpath("_runner.py").read_text(encoding="utf-8")
# The host's last-resort deadline is the program's timeout plus this: runner start-up and cleanup.
HOST_GRACE_S = 10.0
# The runner writes a heartbeat every 0.25 s; this long without one, it is stopped (or frozen).
HEARTBEAT_LOSS_S = 4.0
# ... and this long for the first one (an exec can be slow to start on a loaded machine).
FIRST_HEARTBEAT_S = 10.0
RESET_TIMEOUT_S = 15.0
CLOSE_WAIT_S = 60.0
# System V IPC objects count against the container's memory and outlive the program until the
# runner removes them: they may hold at most a quarter of the memory limit, in a few objects.
IPC_SHARE_OF_MEMORY = 4


@attrs.frozen
class SandboxOptions:
    """Limits and pool shape of a sandbox (the `sandbox` table of a code environment's options)."""

    image: str = ""  # default: the tag `plait-docker build-image` builds
    pool_size: int = attrs.field(
        default=2, validator=positive
    )  # containers = concurrent executions
    reuse_containers: bool = True  # False: a fresh container per execution (slower; for comparison)
    timeout_s: float = attrs.field(default=10.0, validator=positive)  # default per-execution limit
    max_timeout_s: float = attrs.field(default=120.0, validator=positive)
    memory_mb: int = attrs.field(default=256, validator=positive)
    cpus: float = attrs.field(default=1.0, validator=positive)
    pids: int = attrs.field(default=64, validator=positive)
    work_dir_mb: int = attrs.field(default=16, validator=positive)
    work_dir_inodes: int = attrs.field(default=4096, validator=positive)  # files and directories
    output_limit_bytes: int = attrs.field(default=64 * 1024, validator=positive)  # per stream
    max_program_bytes: int = attrs.field(default=64 * 1024, validator=positive)
    max_stdin_bytes: int = attrs.field(default=1024 * 1024, validator=positive)
    acquire_timeout_s: float = attrs.field(default=300.0, validator=positive)

    @property
    def image_tag(self) -> str:
        return self.image or DEFAULT_RECIPE.tag


@attrs.frozen
class ExecutionResult:
    """What one execution did. `ok` is true only for a clean exit with status 0 within every
    limit."""

    reason: str
    detail: str
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    duration_s: float = 0.0
    limits_hit: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.reason == "ok"

    @property
    def engine_fault(self) -> bool:
        """The sandbox failed, not the program (the container was paused, stopped or removed from
        outside, the runner stopped answering, the engine failed): the program's outcome is
        unknown, so this must not be scored as the program's failure."""
        return self.reason == "sandbox_error"

    def summary(self, max_chars: int = 2000) -> str:
        """A text observation for a model: the outcome, then the (clipped) output."""
        parts = [f"[{self.reason}] {self.detail}"]
        if self.stdout:
            parts.append("stdout:\n" + _clip(self.stdout, max_chars))
        if self.stderr:
            parts.append("stderr:\n" + _clip(self.stderr, max_chars))
        return "\n".join(parts)


def _clip(text: str, max_chars: int) -> str:
    return (
        text
        if len(text) <= max_chars
        else text[:max_chars] + f"\n... ({len(text) - max_chars} more characters)"
    )


def _failure(reason: str, detail: str = "", **fields: Any) -> ExecutionResult:
    return ExecutionResult(reason=reason, detail=detail or REASON_DETAILS[reason], **fields)


class SandboxClosedError(EngineError):
    """An execution was requested from a sandbox that has been closed."""


class SandboxFault(EngineError):
    """An execution ended in a fault of the sandbox (`ExecutionResult.engine_fault`), so there is
    no outcome of the program to score."""


# ------------------------------------------------------------------------------------------------
# Ownership labels and the janitor
# ------------------------------------------------------------------------------------------------


def _process_start_ticks(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks since boot), which tells a reused PID apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_label() -> str:
    return f"{os.getpid()}:{_process_start_ticks(os.getpid())}"


def owner_alive(label: str) -> bool:
    pid, _, ticks = label.partition(":")
    return pid.isdigit() and _process_start_ticks(int(pid)) == ticks


def janitor(client: docker.DockerClient, *, everything: bool = False) -> list[str]:
    """Remove sandbox containers whose owning process (on this host) is gone; with `everything`,
    all sandbox containers. Returns the names removed."""
    removed = []
    host = socket.gethostname()
    for container in client.containers.list(all=True, filters={"label": f"{LABEL_SANDBOX}=1"}):
        labels = container.labels
        orphaned = labels.get(LABEL_OWNER_HOST) == host and not owner_alive(
            labels.get(LABEL_OWNER_PID, "")
        )
        if everything or orphaned:
            _remove_container(container)
            removed.append(container.name)
    if removed:
        log.info("janitor removed sandbox containers", count=len(removed), everything=everything)
    return removed


def _remove_container(container: Any) -> None:
    try:
        container.remove(force=True, v=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:
        if exc.status_code != 409:  # 409: removal already in progress
            raise


def _remove_pool_containers(client: docker.DockerClient, pool_id: str) -> None:
    for container in client.containers.list(all=True, filters={"label": f"{LABEL_POOL}={pool_id}"}):
        _remove_container(container)


def _ipc_sysctls(memory_mb: int) -> dict[str, str]:
    """Limits of the container's own IPC namespace: System V objects and POSIX queues."""
    shm_bytes = memory_mb * 2**20 // IPC_SHARE_OF_MEMORY
    return {
        "kernel.shmmax": str(shm_bytes),
        "kernel.shmall": str(shm_bytes // os.sysconf("SC_PAGE_SIZE")),
        "kernel.shmmni": "64",
        "kernel.msgmni": "16",
        "kernel.sem": "32 1024 32 16",
        "fs.mqueue.queues_max": "16",
    }


# ------------------------------------------------------------------------------------------------
# One exec, streamed under a deadline
# ------------------------------------------------------------------------------------------------


class _ContainerUnusable(Exception):
    """The container could not start an exec (gone, stopped, or out of processes)."""


@attrs.define
class _StreamOutcome:
    stdout: bytes
    stderr: bytes  # without the runner's heartbeats
    exit_code: int | None  # None when the host stopped reading (see host_reason)
    host_reason: str | None  # "timeout" | "unresponsive" | "cancelled" | "output_limit" | None
    exec_id: str
    sock: Any
    reader: threading.Thread

    def close(self) -> None:
        """Drop the connection (after a reset has ended the exec, if it had to be stopped)."""
        raw = getattr(self.sock, "_sock", self.sock)
        with contextlib.suppress(OSError):
            raw.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            raw.close()
        response = getattr(self.sock, "_response", None)
        if response is not None:
            response.close()
        self.reader.join(timeout=5)


_END = object()
HEARTBEAT = b"\0"


def _pump(sock: Any, stdin: bytes | None, chunks: queue.Queue) -> None:
    """Send `stdin` (then end it), and queue the exec's (stream, bytes) frames until it ends."""
    try:
        if stdin is not None:
            raw = getattr(sock, "_sock", sock)
            raw.sendall(stdin)
            raw.shutdown(socket.SHUT_WR)
        for frame in docker.utils.socket.frames_iter(sock, tty=False):
            chunks.put(frame)
    except Exception as exc:  # the connection breaks when the container is reset or removed
        chunks.put(exc)
    finally:
        chunks.put(_END)


def _stream_exec(
    api: docker.APIClient,
    container_id: str,
    cmd: list[str],
    *,
    user: str,
    workdir: str,
    deadline: float,
    cancel: threading.Event | None,
    cap_bytes: int,
    stdin: bytes | None = None,
) -> _StreamOutcome:
    """Start `cmd` in the container, send it `stdin`, and read its output until it ends, the
    deadline passes, the runner's heartbeat stops, `cancel` is set, or more than `cap_bytes`
    arrive. The caller closes the outcome (after resetting the container when the exec had to be
    stopped)."""
    try:
        exec_id = api.exec_create(
            container_id,
            cmd,
            user=user,
            workdir=workdir,
            stdin=stdin is not None,
            stdout=True,
            stderr=True,
        )["Id"]
        sock = api.exec_start(exec_id, socket=True)
    except (docker.errors.APIError, requests.RequestException) as exc:
        raise _ContainerUnusable(str(exc)) from exc
    chunks: queue.Queue = queue.Queue()
    reader = threading.Thread(
        target=_pump, args=(sock, stdin, chunks), daemon=True, name="sandbox-exec-reader"
    )
    reader.start()
    out, err = bytearray(), bytearray()
    host_reason = None
    last_sign, silence_allowed = time.monotonic(), FIRST_HEARTBEAT_S
    while True:
        if cancel is not None and cancel.is_set():
            host_reason = "cancelled"
            break
        now = time.monotonic()
        if now >= deadline:
            host_reason = "timeout"
            break
        if now - last_sign > silence_allowed:
            host_reason = "unresponsive"
            break
        try:
            item = chunks.get(timeout=0.05)
        except queue.Empty:
            continue
        if item is _END or isinstance(item, Exception):
            break
        last_sign, silence_allowed = time.monotonic(), HEARTBEAT_LOSS_S
        stream_id, data = item
        if stream_id == docker.utils.socket.STDERR:
            err += data.replace(HEARTBEAT, b"")
        else:
            out += data
        if len(out) + len(err) > cap_bytes:
            host_reason = "output_limit"
            break
    exit_code = None
    if host_reason is None:
        try:
            exit_code = api.exec_inspect(exec_id)["ExitCode"]
        except (docker.errors.APIError, requests.RequestException):
            exit_code = None
    return _StreamOutcome(bytes(out), bytes(err), exit_code, host_reason, exec_id, sock, reader)


# ------------------------------------------------------------------------------------------------
# The pool
# ------------------------------------------------------------------------------------------------


class Sandbox:
    """A pool of locked-down containers that execute Python programs.

    Creating one checks that the engine answers and the image exists (raising `EngineError` with
    the fix otherwise), removes leftovers of crashed owners, and starts `pool_size` warm
    containers (none with `reuse_containers=False`). Thread-safe; `run` is the asyncio form.
    """

    def __init__(
        self, options: SandboxOptions | None = None, *, client: docker.DockerClient | None = None
    ) -> None:
        self.options = options or SandboxOptions()
        self.client = client or connect(timeout_s=self.options.max_timeout_s + HOST_GRACE_S + 30)
        self.image = self.options.image_tag
        require_image(self.client, self.image)
        janitor(self.client)
        self.pool_id = uuid.uuid4().hex[:12]
        self._uid = DEFAULT_RECIPE.sandbox_uid
        self._cond = threading.Condition()
        self._idle: list[Any] = []
        self._live = 0  # containers that exist (idle + busy + being created)
        self._in_flight = 0
        self._serial = 0
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.options.pool_size * 2, thread_name_prefix=f"sandbox-{self.pool_id}"
        )
        # Removes this pool's containers when the Sandbox is collected or the interpreter exits
        # without close(); after a crash, the next Sandbox's janitor does.
        self._finalizer = weakref.finalize(self, _remove_pool_containers, self.client, self.pool_id)
        if self.options.reuse_containers:
            try:
                for _ in range(self.options.pool_size):
                    with self._cond:
                        self._live += 1
                    container = self._create_container_or_release_slot()
                    with self._cond:
                        self._idle.append(container)
            except BaseException:
                self.close()
                raise
        log.info(
            "sandbox ready",
            pool=self.pool_id,
            image=self.image,
            pool_size=self.options.pool_size,
            reuse=self.options.reuse_containers,
        )

    # -- containers --------------------------------------------------------------------------

    def _create_container(self) -> Any:
        opts = self.options
        with self._cond:
            self._serial += 1
            name = f"plait-sandbox-{self.pool_id}-{self._serial}"
        work_dir = DEFAULT_RECIPE.work_dir
        return self.client.containers.run(
            self.image,
            detach=True,
            name=name,
            hostname="sandbox",
            labels={
                LABEL_SANDBOX: "1",
                LABEL_POOL: self.pool_id,
                LABEL_OWNER_HOST: socket.gethostname(),
                LABEL_OWNER_PID: owner_label(),
            },
            user=f"{DEFAULT_RECIPE.init_uid}:{DEFAULT_RECIPE.init_uid}",
            network_mode="none",
            read_only=True,
            tmpfs={
                work_dir: f"rw,noexec,nosuid,nodev,size={opts.work_dir_mb}m,"
                f"nr_inodes={opts.work_dir_inodes},mode=700,uid={self._uid},gid={self._uid}"
            },
            mem_limit=f"{opts.memory_mb}m",
            memswap_limit=f"{opts.memory_mb}m",  # the same as mem_limit: no swap
            nano_cpus=int(opts.cpus * 1e9),
            pids_limit=opts.pids,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges:true", seccomp_security_opt()],
            ulimits=[
                docker.types.Ulimit(name="nofile", soft=256, hard=256),
                docker.types.Ulimit(name="core", soft=0, hard=0),
            ],
            ipc_mode="none",  # a private IPC namespace without a writable /dev/shm
            sysctls=_ipc_sysctls(opts.memory_mb),
            log_config=docker.types.LogConfig(type="none"),
        )

    def _create_container_or_release_slot(self) -> Any:
        try:
            return self._create_container()
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify()
            raise

    def _discard(self, container: Any) -> None:
        try:
            _remove_container(container)
        except (docker.errors.APIError, requests.RequestException) as exc:
            log.warning(
                "could not remove a sandbox container; the janitor will",
                container=container.name,
                error=str(exc),
            )
        with self._cond:
            self._live -= 1
            self._cond.notify()

    def _acquire(self, cancel: threading.Event | None) -> Any | None:
        """A clean container (None if cancelled while waiting)."""
        give_up = time.monotonic() + self.options.acquire_timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise SandboxClosedError("the sandbox is closed", fix="create a new Sandbox")
                if cancel is not None and cancel.is_set():
                    return None
                if self._idle:
                    return self._idle.pop()
                if self._live < self.options.pool_size:
                    self._live += 1
                    break
                if time.monotonic() > give_up:
                    raise EngineError(
                        "no sandbox container became free within "
                        f"{self.options.acquire_timeout_s}s",
                        fix="raise sandbox.pool_size or sandbox.acquire_timeout_s",
                    )
                self._cond.wait(timeout=0.05)
        return self._create_container_or_release_slot()

    def _release(self, container: Any, *, clean: bool) -> None:
        if clean and self.options.reuse_containers:
            with self._cond:
                if not self._closed:
                    self._idle.append(container)
                    self._cond.notify()
                    return
        self._discard(container)

    def _reset(self, container: Any, abandoned_exec: str) -> bool:
        """Kill the sandbox user's processes and wipe what they left; False if that failed.

        The run that was abandoned may not even have started yet (an exec starts after the call
        that starts it has returned), and a runner that starts late would run its program and
        then kill the next execution's runner; so the container is clean only once that exec has
        ended and a reset after it succeeded (a reset's runner and the abandoned one may kill each
        other meanwhile)."""
        give_up = time.monotonic() + RESET_TIMEOUT_S
        while time.monotonic() < give_up:
            try:
                outcome = _stream_exec(
                    self.client.api,
                    container.id,
                    ["python3", "-I", "-B", "-c", RUNNER_SOURCE, "reset"],
                    user=f"{self._uid}:{self._uid}",
                    workdir=DEFAULT_RECIPE.work_dir,
                    deadline=give_up,
                    cancel=None,
                    cap_bytes=65536,
                )
            except _ContainerUnusable:
                return False
            outcome.close()
            if outcome.exit_code == 0 and self._exec_ended(abandoned_exec):
                return True
            time.sleep(0.1)
        return False

    def _exec_ended(self, exec_id: str) -> bool:
        try:
            info = self.client.api.exec_inspect(exec_id)
        except docker.errors.NotFound:
            return True
        except (docker.errors.APIError, requests.RequestException):
            return False
        return not info.get("Running") and info.get("ExitCode") is not None

    def _container_state(self, container: Any) -> str:
        """ "running", "paused", "gone", or the status of a container that is not running."""
        try:
            container.reload()
        except docker.errors.NotFound:
            return "gone"
        except (docker.errors.APIError, requests.RequestException) as exc:
            return f"unknown ({exc})"
        state = container.attrs["State"]
        if state.get("Paused"):
            return "paused"
        if state.get("Running"):
            return "running"
        return f"{state.get('Status')}, exit code {state.get('ExitCode')}"

    # -- executions --------------------------------------------------------------------------

    def execute(
        self,
        code: str,
        *,
        stdin: str | None = None,
        timeout_s: float | None = None,
        cancel: threading.Event | None = None,
    ) -> ExecutionResult:
        """Run the Python program `code` in a container, with `stdin` as its standard input (none:
        an empty one); never raises for anything the program does."""
        opts = self.options
        timeout = min(timeout_s if timeout_s is not None else opts.timeout_s, opts.max_timeout_s)
        if timeout <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        code = code.encode("utf-8", "replace").decode(
            "utf-8"
        )  # lone surrogates cannot be written out
        stdin = (stdin or "").encode("utf-8", "replace").decode("utf-8")
        code_bytes, stdin_bytes = len(code.encode("utf-8")), len(stdin.encode("utf-8"))
        if code_bytes > opts.max_program_bytes:
            return _failure(
                "program_too_large",
                f"the program has {code_bytes} bytes; at most {opts.max_program_bytes} are allowed",
            )
        if stdin_bytes > opts.max_stdin_bytes:
            return _failure(
                "program_too_large",
                f"the input (stdin) has {stdin_bytes} bytes; at most {opts.max_stdin_bytes} are "
                "allowed",
            )
        # The job goes to the runner on its stdin, never on a command line (which the host's process
        # list would show, hidden tests included).
        payload = json.dumps(
            {
                "code": code,
                "stdin": stdin,
                "timeout_s": timeout,
                "output_limit_bytes": opts.output_limit_bytes,
            }
        ).encode()
        with self._cond:
            self._in_flight += 1
        try:
            for attempt in (1, 2):
                if cancel is not None and cancel.is_set():
                    return _failure("cancelled")
                try:
                    container = self._acquire(cancel)
                except (docker.errors.DockerException, requests.RequestException) as exc:
                    return _failure("sandbox_error", f"could not start a sandbox container: {exc}")
                if container is None:
                    return _failure("cancelled")
                try:
                    result, clean = self._execute_in(container, payload, timeout, cancel)
                except _ContainerUnusable as exc:
                    # nothing ran: the container broke before the exec started;
                    # retry once on another
                    self._discard(container)
                    if attempt == 2:
                        return _failure(
                            "sandbox_error", f"the sandbox container is unusable: {exc}"
                        )
                    continue
                except BaseException:
                    self._discard(container)
                    raise
                self._release(container, clean=clean)
                return result
            raise AssertionError("unreachable")
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    def _execute_in(
        self, container: Any, payload: bytes, timeout: float, cancel: threading.Event | None
    ) -> tuple[ExecutionResult, bool]:
        """(result, whether the container is clean and reusable)."""
        started = time.monotonic()
        # The runner's report holds at most two capped streams, JSON-escaped
        # (at most 6 bytes a byte).
        cap = 12 * self.options.output_limit_bytes + 65536
        outcome = _stream_exec(
            self.client.api,
            container.id,
            ["python3", "-I", "-B", "-c", RUNNER_SOURCE, "run"],
            user=f"{self._uid}:{self._uid}",
            workdir=DEFAULT_RECIPE.work_dir,
            deadline=started + timeout + HOST_GRACE_S,
            cancel=cancel,
            cap_bytes=cap,
            stdin=payload,
        )
        try:
            if outcome.host_reason in ("cancelled", "output_limit"):
                clean = self._reset(container, outcome.exec_id)
                return _failure(outcome.host_reason, duration_s=time.monotonic() - started), clean
            if outcome.host_reason is None:
                try:
                    report = json.loads(outcome.stdout)
                    return ExecutionResult(
                        reason=report["reason"],
                        detail=REASON_DETAILS.get(report["reason"], report["reason"]),
                        exit_code=report["exit_code"],
                        stdout=report["stdout"],
                        stderr=report["stderr"],
                        duration_s=report["duration_s"],
                        limits_hit=tuple(report["limits_hit"]),
                    ), outcome.exit_code == 0
                except (ValueError, KeyError, TypeError):
                    pass
            # No report. The program cannot reach the runner, so the runner or the container was
            # stopped from outside, or the engine failed: a fault of the sandbox, not the program's.
            detail, clean = self._diagnose(container, outcome, timeout)
            log.warning("sandbox fault", container=container.name, detail=detail)
            return _failure("sandbox_error", detail, duration_s=time.monotonic() - started), clean
        finally:
            outcome.close()

    def _diagnose(
        self, container: Any, outcome: _StreamOutcome, timeout: float
    ) -> tuple[str, bool]:
        """What went wrong with a run that gave no report (and whether the container is clean
        again)."""
        state = self._container_state(container)
        clean = False
        if state == "running":
            clean = self._reset(container, outcome.exec_id)  # ends a stopped runner too
            if not clean:  # a container being killed may still have looked alive
                state = self._container_state(container)
        if state == "paused":
            return "the sandbox container was paused from outside during the execution", False
        if state == "gone":
            return "the sandbox container was removed from outside during the execution", False
        if state.startswith("unknown"):
            return f"the engine did not say what became of the sandbox container: {state}", False
        if state != "running":
            return (
                f"the sandbox container stopped during the execution ({state}): killed or stopped "
                "from outside",
                False,
            )
        if outcome.host_reason == "unresponsive":
            return (
                "the sandbox runner stopped responding (no heartbeat for "
                f"{HEARTBEAT_LOSS_S:.0f}s): stopped from outside, or the engine stalled"
            ), clean
        if outcome.host_reason == "timeout":
            return f"the sandbox runner gave no result within {timeout + HOST_GRACE_S:.0f}s", clean
        stderr_tail = outcome.stderr.decode("utf-8", "replace")[-500:]
        return (
            "the sandbox runner ended without a readable report "
            f"(exit status {outcome.exit_code}): killed from outside, or it failed. {stderr_tail}"
        ).strip(), clean

    async def run(
        self, code: str, *, stdin: str | None = None, timeout_s: float | None = None
    ) -> ExecutionResult:
        """`execute` on a worker thread. Cancelling the awaiting task stops the execution; the
        cancellation propagates once the container has been cleaned up, so that when `run` returns
        or raises, nothing of the execution is left running."""
        cancel = threading.Event()
        future = self._executor.submit(
            self.execute, code, stdin=stdin, timeout_s=timeout_s, cancel=cancel
        )
        wrapped = asyncio.wrap_future(future)
        try:
            return await asyncio.shield(wrapped)
        except asyncio.CancelledError:
            cancel.set()
            future.cancel()  # one that has not started never will
            while not wrapped.done():
                # cancelled again: still finish cleaning up; its own outcome no longer matters
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.shield(wrapped)
            raise

    # -- lifecycle ---------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"live": self._live, "idle": len(self._idle), "in_flight": self._in_flight}

    def close(self) -> None:
        """Stop accepting executions, let running ones finish their cleanup, remove every
        container."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            give_up = time.monotonic() + CLOSE_WAIT_S
            while self._in_flight and time.monotonic() < give_up:
                self._cond.wait(timeout=0.1)
            idle, self._idle = self._idle, []
        for container in idle:
            self._discard(container)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._finalizer()  # whatever is still labelled with this pool
        log.info("sandbox closed", pool=self.pool_id)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
