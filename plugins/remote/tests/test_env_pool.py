"""The "pool" environment: math.arith on several `plait env serve` processes, episodes spread
within each member's cap, members joining and draining mid-episode without losing one, a member
that dies costing only its own episodes, and the options reaching the members."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest

from plait.api import EpisodeConfig, ResolvedModel, SamplingParams

pytestmark = pytest.mark.slow

SLOW_VERIFIER = {"preset": "tiny", "verify_seconds": 0.4}


@pytest.fixture
def episodes(tiny_model: ResolvedModel) -> Callable[..., Any]:
    """(pool, n) -> the n episodes' trajectories, run at once with plait-torch sampling tiny-qwen3;
    while they run, `pool.peaks` records the most episodes each member ran at once."""
    from plait_hf.chat_template import ChatTemplateRenderer
    from plait_torch.inference import TorchInferenceEngine

    engine = TorchInferenceEngine(tiny_model)
    renderer = ChatTemplateRenderer(engine.tokenizer)
    config = EpisodeConfig(SamplingParams(max_tokens=4, temperature=1.0, seed=0))

    async def run(pool: Any, n: int, during: Callable[[], Any] | None = None) -> list[Any]:
        tasks = [await pool.get_task("train", i) for i in range(n)]
        pool.peaks = {}

        async def watch() -> None:
            while True:
                for member in pool.members:
                    pool.peaks[member.name] = max(pool.peaks.get(member.name, 0), member.in_flight)
                await asyncio.sleep(0.02)

        watcher = asyncio.ensure_future(watch())
        running = asyncio.gather(
            *(pool.run_episode(task, engine, renderer, config) for task in tasks)
        )
        if during is not None:
            await during()
        try:
            return list(await running)
        finally:
            watcher.cancel()

    return run


def make_pool(**options: Any) -> Any:
    from plait_remote.env_pool import EnvPool
    from plait_remote.options import EnvPoolOptions

    return EnvPool(EnvPoolOptions(**{"env": "math.arith", "env_options": SLOW_VERIFIER, **options}))


def test_episodes_spread_over_the_members_within_each_cap(episodes) -> None:
    async def body() -> None:
        pool = make_pool(members=2, max_in_flight=2)
        try:
            trajectories = await episodes(pool, 10)
            assert all(t.error is None and t.finished for t in trajectories), [
                t.error for t in trajectories
            ]
            assert sorted(pool.peaks.values()) == [2, 2], pool.peaks
            assert sum(m.episodes for m in pool.members) == 10 and all(
                m.episodes >= 4 for m in pool.members
            )
            assert (
                await pool.num_tasks("train")
            ) == 100_000  # tasks served by the members (options reached them)
        finally:
            await pool.close()
        assert not pool.members

    asyncio.run(asyncio.wait_for(body(), 300))


def test_members_join_and_drain_mid_run_without_losing_an_episode(episodes) -> None:
    async def body() -> None:
        pool = make_pool(members=1, max_in_flight=2)

        async def grow_then_shrink() -> None:
            await asyncio.sleep(0.5)
            await pool.scale(3)  # two members join while episodes run
            assert len(pool.members) == 3
            await asyncio.sleep(1.0)
            await pool.scale(1)  # the two newest drain: their running episodes finish

        try:
            trajectories = await episodes(pool, 16, grow_then_shrink)
            assert all(t.error is None and t.finished for t in trajectories), [
                t.error for t in trajectories
            ]
            assert len(pool.peaks) == 3 and all(peak <= 2 for peak in pool.peaks.values()), (
                pool.peaks
            )
            for _ in range(100):  # drained members stop once their episodes are done
                if len(pool.members) == 1:
                    break
                await asyncio.sleep(0.1)
            assert len(pool.members) == 1 and pool.members[0].name.endswith("#1")
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(body(), 300))


def test_a_member_that_dies_costs_only_its_running_episodes(episodes) -> None:
    async def body() -> None:
        pool = make_pool(members=2, max_in_flight=3)

        async def kill_one() -> None:
            await asyncio.sleep(1.0)
            os.kill(pool.members[1].server.pid, signal.SIGKILL)

        try:
            trajectories = await episodes(pool, 12, kill_one)
            failed = [t for t in trajectories if t.error is not None]
            assert 0 < len(failed) <= 3, [
                t.error for t in trajectories
            ]  # at most its cap was running on it
            assert len(pool.members) == 1
            again = await episodes(pool, 3)  # the pool goes on with the member left
            assert all(t.error is None for t in again)
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(body(), 300))


def test_the_pool_autoscales_by_the_episodes_that_wait_for_room(episodes) -> None:
    from plait_remote.scale import AutoscaleOptions

    async def body() -> None:
        pool = make_pool(
            members=1,
            max_in_flight=2,
            poll_s=0.05,
            autoscale=AutoscaleOptions(min=1, max=2, stall_s=0.3, idle_s=1.0),
        )
        try:
            trajectories = await episodes(pool, 16)
            assert all(t.error is None and t.finished for t in trajectories), [
                t.error for t in trajectories
            ]
            assert len(pool.peaks) == 2, "episodes that waited for room brought a second member"
            for _ in range(100):  # calm: it drains back to its minimum
                if len(pool.members) == 1:
                    break
                await asyncio.sleep(0.1)
            assert len(pool.members) == 1
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(body(), 300))
