"""Requests that answer later: each training run's `seq_id` order (`Sequencer`) and the futures
the SDK long-polls (`Futures`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import attrs
import structlog

from plait_tinker.errors import not_found

log = structlog.get_logger("plait_tinker")


class Sequencer:
    """One training run's requests, one at a time, in `seq_id` order. A gap (a seq_id that never
    arrives) holds the next ones for `gap_s`, then the lowest waiting goes on."""

    def __init__(self, gap_s: float = 30.0) -> None:
        self.next_seq = 1
        self.gap_s = gap_s
        self._waiting: set[int] = set()
        self._arrived: set[int] = set()
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def turn(self, seq_id: int) -> AsyncIterator[None]:
        async with self._changed:
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
            finally:
                self._waiting.discard(seq_id)
        try:
            yield
        finally:
            async with self._changed:
                self.next_seq = max(self.next_seq, seq_id + 1)
                self._arrived = {seq for seq in self._arrived if seq >= self.next_seq}
                self._changed.notify_all()


@attrs.define
class Pending:
    tenant: str
    task: asyncio.Task[Any]
    finished_at: float | None = None


class Futures:
    """Requests that answer later: an id now, the result by `wait` (long-poll). A resubmitted
    request (same key: a run's seq_id) gets the first one's id; results are kept for a while
    after they finish, because a client whose poll timed out asks again."""

    KEEP_S = 600.0

    def __init__(self) -> None:
        self._items: dict[str, Pending] = {}
        self._by_key: dict[tuple[Any, ...], str] = {}
        self._ids = itertools.count(1)
        self._swept = time.monotonic()

    def submit(self, tenant: str, work: Awaitable[Any], key: tuple[Any, ...] | None = None) -> str:
        if key is not None and key in self._by_key:
            close = getattr(work, "close", None)
            if close:
                close()  # a coroutine that will never run
            return self._by_key[key]
        request_id = f"req-{next(self._ids)}"
        pending = Pending(tenant, asyncio.ensure_future(work))
        pending.task.add_done_callback(lambda _t: setattr(pending, "finished_at", time.monotonic()))
        self._items[request_id] = pending
        if key is not None:
            self._by_key[key] = request_id
        self._forget_old()
        return request_id

    async def wait(
        self, tenant: str, request_id: str, timeout_s: float
    ) -> asyncio.Task[Any] | None:
        """The finished task, or None when it is still running after `timeout_s`."""
        pending = self._items.get(request_id)
        if pending is None or pending.tenant != tenant:
            raise not_found(f"request {request_id!r}")
        done, _ = await asyncio.wait([pending.task], timeout=timeout_s)
        return pending.task if done else None

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
