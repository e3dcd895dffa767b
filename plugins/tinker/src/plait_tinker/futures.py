"""Requests that answer later: each training run's `seq_id` order (`Sequencer`) and the futures
the SDK long-polls (`Futures`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import structlog

from plait_tinker.errors import not_found

log = structlog.get_logger("plait_tinker")


class Sequencer:
    """One training run's requests, one at a time, in `seq_id` order. A request refused before it
    ran, or cancelled while waiting, settles its place at once (`settle`), so the next one goes
    on. A gap (a seq_id that never arrives) holds the next ones for `gap_s`, then the lowest
    waiting goes on."""

    def __init__(self, gap_s: float = 30.0) -> None:
        self.next_seq = 1
        self.gap_s = gap_s
        self._waiting: set[int] = set()
        self._arrived: set[int] = set()
        self._settled: set[int] = set()
        self._changed = asyncio.Event()

    def settle(self, seq_id: int) -> None:
        """`seq_id` takes no turn: its request was refused or cancelled."""
        self._arrived.add(seq_id)
        self._settled.add(seq_id)
        self._advance()

    def _advance(self) -> None:
        while self.next_seq in self._settled:
            self.next_seq += 1
        self._settled = {seq for seq in self._settled if seq >= self.next_seq}
        self._arrived = {seq for seq in self._arrived if seq >= self.next_seq}
        self._changed.set()
        self._changed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def turn(self, seq_id: int) -> AsyncIterator[None]:
        self._waiting.add(seq_id)
        self._arrived.add(seq_id)
        try:
            while seq_id > self.next_seq:
                try:
                    await asyncio.wait_for(self._changed.wait(), self.gap_s)
                except TimeoutError:
                    # only a seq_id that never arrived is skipped, never one still running
                    if self.next_seq not in self._arrived and seq_id == min(self._waiting):
                        log.warning(
                            "a request never came; going on without it",
                            missing=self.next_seq,
                            seq_id=seq_id,
                        )
                        break
        except asyncio.CancelledError:
            self.settle(seq_id)
            raise
        finally:
            self._waiting.discard(seq_id)
        try:
            yield
        finally:
            self.next_seq = max(self.next_seq, seq_id + 1)
            self._advance()


@attrs.define
class Pending:
    tenant: str
    session: str
    task: asyncio.Task[Any]
    finished_at: float | None = None
    polls: int = 0
    """Long-polls waiting on it now."""
    last_poll: float = 0.0


class Futures:
    """Requests that answer later: an id now, the result by `wait` (long-poll). A resubmitted
    request (same key: a run's seq_id) gets the first one's id; results are kept for a while
    after they finish, because a client whose poll timed out asks again.

    A client that drops its poll (its process died, or it cancelled the call) and does not poll
    again within `abandon_s` has abandoned the request: it is cancelled, and `on_abandoned` hears
    of its session."""

    KEEP_S = 600.0

    def __init__(self, abandon_s: float, on_abandoned: Callable[[str], None]) -> None:
        self.abandon_s = abandon_s
        self._on_abandoned = on_abandoned
        self._items: dict[str, Pending] = {}
        self._by_key: dict[tuple[Any, ...], str] = {}
        self._ids = itertools.count(1)
        self._swept = time.monotonic()

    def submit(
        self, tenant: str, session: str, work: Awaitable[Any], key: tuple[Any, ...] | None = None
    ) -> str:
        if key is not None and key in self._by_key:
            close = getattr(work, "close", None)
            if close:
                close()  # a coroutine that will never run
            return self._by_key[key]
        request_id = f"req-{next(self._ids)}"
        pending = Pending(tenant, session, asyncio.ensure_future(work), last_poll=time.monotonic())
        pending.task.add_done_callback(lambda _t: setattr(pending, "finished_at", time.monotonic()))
        self._items[request_id] = pending
        if key is not None:
            self._by_key[key] = request_id
        self._forget_old()
        return request_id

    def pending(self, tenant: str, request_id: str) -> Pending:
        pending = self._items.get(request_id)
        if pending is None or pending.tenant != tenant:
            raise not_found(f"request {request_id!r}")
        return pending

    async def wait(
        self, pending: Pending, timeout_s: float, gone: Awaitable[Any]
    ) -> asyncio.Task[Any] | None:
        """The finished task, or None when it is still running after `timeout_s` or the poller
        went away first (`gone` finished)."""
        pending.polls += 1
        pending.last_poll = time.monotonic()
        watch = asyncio.ensure_future(gone)
        try:
            await asyncio.wait(
                [pending.task, watch], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            pending.polls -= 1
            watch.cancel()
        if pending.task.done():
            return pending.task
        if watch.done() and not watch.cancelled():
            dropped = time.monotonic()
            asyncio.get_running_loop().call_later(self.abandon_s, self._abandon, pending, dropped)
        return None

    def _abandon(self, pending: Pending, dropped: float) -> None:
        if pending.task.done() or pending.polls or pending.last_poll > dropped:
            return  # answered, or polled again
        log.info("its client went away; cancelling the request", session=pending.session)
        pending.task.cancel()
        self._on_abandoned(pending.session)

    def cancel_session(self, session: str) -> None:
        """Cancel what a finished session still has queued or running."""
        for pending in self._items.values():
            if pending.session == session and not pending.task.done():
                pending.task.cancel()

    def _forget_old(self) -> None:
        now = time.monotonic()
        if now - self._swept < 10.0:  # a sweep reads every kept request: not on every submit
            return
        self._swept = now
        old = [
            rid
            for rid, p in self._items.items()
            if p.finished_at is not None and now - p.finished_at > self.KEEP_S
        ]
        for rid in old:
            del self._items[rid]
        if old:
            self._by_key = {k: rid for k, rid in self._by_key.items() if rid in self._items}
