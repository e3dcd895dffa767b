"""TrainingBatcher on a stand-in trainer: which forward_backward calls share a pass."""

from __future__ import annotations

import asyncio
from typing import Any

from plait_tinker import wire
from plait_tinker.batcher import TrainingBatcher


class Host:
    """forward_backward_adapters that records the runs of every pass."""

    def __init__(self) -> None:
        self.passes: list[list[str]] = []

    def forward_backward_adapters(self, calls: list[Any], loss_fn: str, config: Any) -> list[str]:
        self.passes.append(sorted(engine.name for engine, _ in calls))
        return [engine.name for engine, _ in calls]


class Run:
    def __init__(self, name: str, host: Host) -> None:
        self.name, self.host = name, host

    def forward_backward(self, data: Any, loss_fn: str, config: Any) -> str:
        self.host.passes.append([self.name])
        return self.name


async def on_the_trainer(fn: Any, *args: Any) -> Any:
    await asyncio.sleep(0.02)  # a pass takes a while
    return fn(*args)


def call(name: str) -> wire.ForwardBackwardCall:
    return wire.ForwardBackwardCall(name, 0, [], "cross_entropy", {}, False)


def test_runs_that_arrive_together_after_an_idle_spell_share_the_first_pass() -> None:
    """Three runs trained together; after a pause their clients set off again a millisecond or
    two apart (a request's way through the server): all three go into the first pass. A run
    alone is not kept waiting for others."""

    async def main() -> list[list[str]]:
        host = Host()
        batcher = TrainingBatcher(host, on_the_trainer)  # type: ignore[arg-type]
        runs = [Run(name, host) for name in ("a", "b", "c")]
        await asyncio.gather(*(batcher.forward_backward(r, call(r.name)) for r in runs))  # type: ignore[arg-type]

        async def late(run: Run, delay: float) -> str:
            await asyncio.sleep(delay)
            return await batcher.forward_backward(run, call(run.name))  # type: ignore[arg-type]

        await asyncio.sleep(0.2)
        await asyncio.gather(*(late(r, 0.002 * i) for i, r in enumerate(runs)))

        alone = TrainingBatcher(host, on_the_trainer)  # type: ignore[arg-type]
        alone.SETTLE_S = alone.MAX_GATHER_S = 10.0  # would be felt if it applied
        await asyncio.wait_for(alone.forward_backward(runs[0], call("a")), 1.0)  # type: ignore[arg-type]
        return host.passes

    assert asyncio.run(main()) == [["a", "b", "c"], ["a", "b", "c"], ["a"]]
