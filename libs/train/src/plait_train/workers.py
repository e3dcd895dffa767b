"""Trainer ranks in worker processes, started and supervised by an engine object in the controller.

A multi-process trainer engine (FSDP, Megatron) is one object in the controller process that
starts one worker process per rank and forwards each protocol call to all of them. The
controller stays a single process that never joins a collective, so it can always tell what
went wrong:

- a rank that dies (crash, OOM kill) fails the call at once with its rank, pid and exit status;
- a rank that does not answer within the call's timeout is diagnosed from stack dumps of every
  rank (`faulthandler` on SIGUSR1): a rank blocked inside torch.distributed waits for its peers,
  any other rank is the one stuck, and the error names it with the place it is stuck at;
- an exception on a rank is raised in the controller (a `PlaitError` keeps its type and fix).

After a death, a hang, or an error that leaves the other ranks stuck, the whole group is
stopped and every later call raises `EngineError`: start a new engine (and `load_state`) to go on.

The ranks' process group rendezvous through a `TCPStore` hosted here (port chosen by the OS, so
no port race). Workers die with the controller (PR_SET_PDEATHSIG on Linux; their parent is the
forkserver, which exits with the controller).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from plait.api import EngineError, PlaitError

log = structlog.get_logger("plait_train.workers")

_STACK_WAIT_S = 3.0
_ERROR_GRACE_S = 10.0


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _worker_main(
    target: str,
    rank: int,
    world_size: int,
    store: tuple[str, int],
    setup: Any,
    conn: multiprocessing.connection.Connection,
    stack_file: str,
) -> None:
    """A rank's process: build `target(rank, world_size, store, setup)`, then serve calls."""
    _die_with_parent()
    # Append mode: the controller empties the file before asking for a dump.
    stacks = open(stack_file, "a")  # noqa: SIM115 - kept open for faulthandler until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    from plait.api import load_target

    try:
        rank_object = load_target(target)(rank, world_size, store, setup)
        conn.send(("ok", getattr(rank_object, "info", None)))
    except BaseException as exc:  # reported to the controller
        conn.send(_error_reply(exc))
        return
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):  # the controller went away
            return
        if method == "close":
            with contextlib.suppress(Exception):
                getattr(rank_object, "close", lambda: None)()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(rank_object, method)(*args)))
        except BaseException as exc:  # reported to the controller
            conn.send(_error_reply(exc))


def _error_reply(exc: BaseException) -> tuple[Any, ...]:
    trace = "".join(traceback.format_exception(exc))
    if isinstance(exc, PlaitError):
        return (
            "plait_error",
            type(exc).__module__,
            type(exc).__qualname__,
            exc.message,
            exc.fix,
            trace,
        )
    return ("error", f"{type(exc).__name__}: {exc}", trace)


def _rebuild_plait_error(module: str, qualname: str, message: str, fix: str | None) -> PlaitError:
    import importlib

    try:
        cls = getattr(importlib.import_module(module), qualname)
        error = cls.__new__(cls)
    except (ImportError, AttributeError, TypeError):
        error = EngineError.__new__(EngineError)
    PlaitError.__init__(error, message, fix=fix)
    return error


def _first_frame(dump: str) -> tuple[str | None, bool]:
    """(innermost frame of the dumped main thread, whether it sits in torch.distributed)."""
    blocks = [b for b in dump.split("\n\n") if b.strip()]
    main = next((b for b in blocks if "in _worker_main" in b), None)
    if main is None:
        return None, False
    frames = [line.strip() for line in main.splitlines()[1:] if line.strip().startswith("File")]
    waiting = any("torch/distributed" in f or "torch\\distributed" in f for f in frames[:4])
    return frames[0], waiting


def tensor_to_wire(tensor: Any) -> tuple[str, Any]:
    """A CPU copy of a torch tensor that pickles as plain bytes (no shared-memory handles)."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return "bfloat16", tensor.view(torch.int16).numpy()
    return str(tensor.dtype).removeprefix("torch."), tensor.numpy()


def tensor_from_wire(wire: tuple[str, Any]) -> Any:
    import torch

    dtype, array = wire
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


class WorkerGroup:
    """`world_size` worker processes, each serving one rank object built from `target`.

    `target` is a lazy "module:Class"; the class is called as `Class(rank, world_size, store,
    setup)` with `store` = (host, port) of the rendezvous TCPStore, and its methods are what
    `call` invokes. An optional `info` attribute is returned from start-up (see `infos`).
    """

    def __init__(
        self,
        target: str,
        *,
        world_size: int,
        setup: Any,
        name: str = "trainer",
        start_timeout_s: float = 600.0,
        preload: Sequence[str] = (),
    ) -> None:
        import torch.distributed as dist

        self.name = name
        self.world_size = world_size
        self._failure: str | None = None
        self._stack_dir = Path(tempfile.mkdtemp(prefix=f"plait-{name.replace(' ', '-')}-stacks-"))
        # The stack files only matter once a hang is diagnosed (`_fail_hang` keeps them); they go
        # when the group stops, or at the latest when it is collected or the process exits.
        self._remove_stacks = weakref.finalize(
            self, shutil.rmtree, self._stack_dir, ignore_errors=True
        )
        self.store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
        address = ("127.0.0.1", int(self.store.port))
        context: multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext
        if "forkserver" in multiprocessing.get_all_start_methods():
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(["plait_train.workers", *preload])
        else:
            context = multiprocessing.get_context("spawn")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[Any] = []
        for rank in range(world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=_worker_main,
                name=f"plait-{name}-rank{rank}",
                daemon=True,
                args=(target, rank, world_size, address, setup, child, str(self._stack_file(rank))),
            )
            process.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(process)
        log.info(
            "worker processes started",
            engine=name,
            world_size=world_size,
            pids=[p.pid for p in self._procs],
        )
        self.infos = self._collect("start-up", start_timeout_s)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def alive(self) -> bool:
        return self._failure is None and all(p.is_alive() for p in self._procs)

    def call(self, method: str, *args: Any, timeout_s: float) -> list[Any]:
        """`method(*args)` on every rank; their results, by rank."""
        return self.call_each(method, [args] * self.world_size, timeout_s=timeout_s)

    def call_each(
        self, method: str, args: Sequence[tuple[Any, ...]], *, timeout_s: float
    ) -> list[Any]:
        """`method(*args[rank])` on every rank; their results, by rank."""
        if self._failure is not None:
            raise EngineError(
                f"the {self.name}'s worker processes are stopped: {self._failure}",
                fix="create a new trainer (and load_state from the last saved state)",
            )
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((method, args[rank]))
            except (BrokenPipeError, OSError):
                self._fail_dead(method, rank)
        return self._collect(method, timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask every rank to finish, then make sure the processes are gone."""
        if self._failure is None:
            with contextlib.suppress(PlaitError):
                self.call("close", timeout_s=timeout_s)
            self._failure = "closed"
        self._stop()

    # -- internals ---------------------------------------------------------------------------

    def _stack_file(self, rank: int) -> Path:
        return self._stack_dir / f"rank{rank}.txt"

    def _collect(self, method: str, timeout_s: float) -> list[Any]:
        replies: dict[int, tuple[Any, ...]] = {}
        deadline = time.monotonic() + timeout_s
        first_error: int | None = None
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        answered = set()
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if first_error is not None:
                    self._fail_error(
                        method, first_error, replies[first_error], stuck=sorted(waiting.values())
                    )
                self._fail_hang(method, timeout_s, sorted(waiting.values()))
            watched = [s for s in sentinels if s not in answered]
            ready = multiprocessing.connection.wait(
                [*waiting, *watched], timeout=min(remaining, 1.0)
            )
            # Replies first: a rank may answer and exit (close) within one wait.
            for item in sorted(ready, key=lambda item: item not in waiting):
                if item in waiting:
                    rank = waiting.pop(item)
                    try:
                        replies[rank] = item.recv()
                    except (EOFError, OSError):
                        self._fail_dead(method, rank)
                    answered.add(self._procs[rank].sentinel)
                    if replies[rank][0] != "ok" and first_error is None:
                        first_error = rank
                        # The others may be blocked in a collective that the failed rank left.
                        deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
                elif item not in answered:
                    self._fail_dead(method, sentinels[item])
        if first_error is not None:
            self._raise_error(first_error, replies[first_error])
        return [replies[rank][1] for rank in range(self.world_size)]

    def _raise_error(self, rank: int, reply: tuple[Any, ...]) -> None:
        if reply[0] == "plait_error":
            _, module, qualname, message, fix, trace = reply
            log.warning("trainer rank raised", engine=self.name, rank=rank, traceback=trace)
            raise _rebuild_plait_error(module, qualname, message, fix)
        _, summary, trace = reply
        raise EngineError(
            f"{self.name} rank {rank} failed: {summary}\n--- traceback of rank {rank} ---\n{trace}"
        )

    def _fail_error(self, method: str, rank: int, reply: tuple[Any, ...], stuck: list[int]) -> None:
        summary = reply[3] if reply[0] == "plait_error" else reply[1]
        self._failure = (
            f"rank {rank} failed in {method} ({summary}) and rank(s) {stuck} did not finish "
            f"within {_ERROR_GRACE_S:g} s after it"
        )
        self._stop()
        self._raise_error(rank, reply)

    def _fail_dead(self, method: str, rank: int) -> None:
        process = self._procs[rank]
        process.join(timeout=1.0)
        code = process.exitcode
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with status {code}"
        )
        self._failure = f"{self.name} rank {rank} (pid {process.pid}) {how} during {method}"
        self._stop()
        raise EngineError(
            self._failure + "; the other ranks were stopped",
            fix="check that rank's log (out of memory? killed?); then create a new trainer "
            "and load_state from the last saved state",
        )

    def _fail_hang(self, method: str, timeout_s: float, silent: list[int]) -> None:
        for rank in silent:
            self._stack_file(rank).write_text("")
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(_STACK_WAIT_S)
        stuck, waiting, lines = [], [], []
        for rank in silent:
            frame, in_collective = _first_frame(self._stack_file(rank).read_text())
            if frame is None:
                stuck.append(rank)
                lines.append(f"rank {rank}: no stack dump (stopped, or stuck outside Python)")
            elif in_collective:
                waiting.append(rank)
                lines.append(f"rank {rank}: waiting in a collective at {frame}")
            else:
                stuck.append(rank)
                lines.append(f"rank {rank}: stuck at {frame}")
        self._remove_stacks.detach()  # the error message points at them
        culprits = stuck or silent
        self._failure = (
            f"{self.name} rank(s) {culprits} did not answer {method} within {timeout_s:g} s"
            + (f" (rank(s) {waiting} wait for them in a collective)" if stuck and waiting else "")
        )
        self._stop()
        raise EngineError(
            self._failure
            + "; the ranks were stopped.\n"
            + "\n".join(lines)
            + f"\nfull stack dumps: {self._stack_dir}",
            fix="raise the call timeout if the work is just slow; "
            "otherwise see the stuck rank's stack",
        )

    def _stop(self) -> None:
        for process in self._procs:
            if process.is_alive():
                process.terminate()
        for process in self._procs:
            process.join(timeout=5.0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._remove_stacks()
