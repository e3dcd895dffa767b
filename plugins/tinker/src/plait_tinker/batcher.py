"""Shared passes: the forward_backward and optim_step requests of one base model's training
runs, batched onto the trainer's thread."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from plait.api import AdamParams, AdapterEngine, AdapterTrainer
from plait_tinker import wire


class TrainingBatcher:
    """The forward_backward and optim_step requests of one base model's runs, batched: the
    forward_backward requests that are ready go together into shared passes
    (`AdapterTrainer.forward_backward_adapters`), the optim_step requests that are ready into one
    call on the trainer's thread. Each run has at most one request in flight, so every pass
    serves every waiting run once. Before a pass, the batcher waits a little (at most half the
    last pass, and `MAX_GATHER_S`) for the runs of the last pass that have not come back yet:
    their clients are a round trip behind the others, and a pass of its own costs a straggler
    most of a shared pass. After an idle spell, while other runs have trained lately, a
    forward_backward waits for the ones right behind it (until `SETTLE_S` passes without one,
    `MAX_GATHER_S` at most): clients set off together arrive over a few milliseconds, and those
    that missed the first pass would otherwise make passes of their own until a gather caught
    them. Calls with different losses run apart, and when a shared pass fails its calls run
    alone, so that one bad request fails only itself."""

    MAX_GATHER_S = 0.1
    SETTLE_S = 0.005
    RECENT_S = 30.0
    """Runs that were in a pass this long ago are expected back (for `SETTLE_S`)."""

    def __init__(self, host: AdapterTrainer, train: Callable[..., Awaitable[Any]]) -> None:
        self.host = host
        self._train = train
        self._waiting: list[
            tuple[AdapterEngine, wire.ForwardBackwardCall, asyncio.Future[Any]]
        ] = []
        self._stepping: list[tuple[AdapterEngine, AdamParams, asyncio.Future[Any]]] = []
        self._arrived = asyncio.Event()
        self._last_pass: set[AdapterEngine] = set()
        self._last_pass_s = 0.0
        self._seen: dict[AdapterEngine, float] = {}  # each run's last pass (the loop's clock)
        self._draining: asyncio.Task[None] | None = None
        self.passes = self.calls = self.step_batches = 0

    async def forward_backward(self, engine: AdapterEngine, call: wire.ForwardBackwardCall) -> Any:
        return await self._queue(self._waiting, engine, call)

    async def optim_step(self, engine: AdapterEngine, params: AdamParams) -> Any:
        return await self._queue(self._stepping, engine, params)

    async def _queue(self, queue: list[Any], engine: AdapterEngine, request: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        queue.append((engine, request, future))
        self._arrived.set()
        if self._draining is None or self._draining.done():
            self._draining = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # requests that arrive in the same moment join the first pass
        gather_until: float | None = None
        loop = asyncio.get_running_loop()
        if self._waiting and not self._stepping and self._others_expected(loop.time()):
            settle_until = loop.time() + self.MAX_GATHER_S
            while loop.time() < settle_until:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(
                        self._arrived.wait(), min(self.SETTLE_S, settle_until - loop.time())
                    )
                except TimeoutError:
                    break
        while self._waiting or self._stepping:
            if self._stepping:
                steps = [item for item in self._stepping if not item[2].done()]
                self._stepping = []
                await self._step(steps)
                continue
            if gather_until is None:
                gather_until = loop.time() + min(self.MAX_GATHER_S, self._last_pass_s / 2)
            missing = self._last_pass - {engine for engine, _, _ in self._waiting}
            if missing and loop.time() < gather_until:
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), gather_until - loop.time())
                continue
            gather_until = None
            # a request whose client went away was cancelled: its run may be closing
            ready = [item for item in self._waiting if not item[2].done()]
            self._waiting = []
            self._last_pass = {engine for engine, _, _ in ready}
            began = loop.time()
            self._seen = {e: t for e, t in self._seen.items() if began - t < self.RECENT_S}
            self._seen.update(dict.fromkeys(self._last_pass, began))
            by_loss: dict[
                tuple[Any, ...],
                list[tuple[AdapterEngine, wire.ForwardBackwardCall, asyncio.Future[Any]]],
            ] = {}
            for item in ready:
                by_loss.setdefault(
                    (item[1].loss_fn, *sorted(item[1].loss_fn_config.items())), []
                ).append(item)
            for items in by_loss.values():
                await self._run(items)
            self._last_pass_s = loop.time() - began

    def _others_expected(self, now: float) -> bool:
        """Whether runs other than the waiting ones were in a pass within `RECENT_S`."""
        waiting = {engine for engine, _, _ in self._waiting}
        return any(now - t < self.RECENT_S for e, t in self._seen.items() if e not in waiting)

    async def _step(
        self, items: list[tuple[AdapterEngine, AdamParams, asyncio.Future[Any]]]
    ) -> None:
        self.step_batches += 1

        def step_each() -> list[tuple[bool, Any]]:
            outcomes: list[tuple[bool, Any]] = []
            for engine, params, _ in items:
                try:
                    outcomes.append((True, engine.optim_step(params)))
                except Exception as exc:  # one run's failure is its own
                    outcomes.append((False, exc))
            return outcomes

        for (_, _, future), (ok, value) in zip(items, await self._train(step_each), strict=True):
            if future.done():
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)

    async def _run(
        self, items: list[tuple[AdapterEngine, wire.ForwardBackwardCall, asyncio.Future[Any]]]
    ) -> None:
        call = items[0][1]
        self.passes, self.calls = self.passes + 1, self.calls + len(items)
        try:
            if len(items) == 1:
                outputs = [
                    await self._train(
                        items[0][0].forward_backward, call.data, call.loss_fn, call.loss_fn_config
                    )
                ]
            else:
                outputs = await self._train(
                    self.host.forward_backward_adapters,
                    [(e, c.data) for e, c, _ in items],
                    call.loss_fn,
                    call.loss_fn_config,
                )
        except Exception as exc:
            if len(items) == 1:
                if not items[0][2].done():
                    items[0][2].set_exception(exc)
                return
            for item in items:  # find the culprit: each alone
                await self._run([item])
            return
        for (_, _, future), output in zip(items, outputs, strict=True):
            if not future.done():
                future.set_result(output)
