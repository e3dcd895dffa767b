"""The "pool" inference engine: the contract kit through a pool, and what a pool adds: requests
spread over replicas, replicas that join with the newest weights, scale-down that drains, a dead
replica's requests sent to another, scaling from a file, and autoscaling by the queue."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from plait.api import AdamParams, ModelInput, ResolvedModel, SamplingParams, WeightUpdate
from plait_testing.inference import InferenceEngineContract
from plait_testing.trainer import random_tokens, sft_datum, vocab_size


def torch_pool(model: ResolvedModel, replicas: int, **options):
    from plait_remote.options import PoolOptions, ReplicaSpec
    from plait_remote.pool import PoolEngine

    return PoolEngine(
        model, options=PoolOptions(replicas=[ReplicaSpec("torch", {}, replicas)], **options), seed=0
    )


class TestPoolOfOne(InferenceEngineContract):
    """Every promise of an inference engine holds through the pool (one in-process replica: the
    kit's pause tests need to know which engine runs the long request)."""

    @pytest.fixture
    def model(self, tiny_model: ResolvedModel) -> ResolvedModel:
        return tiny_model

    @pytest.fixture
    def make_engine(self, model: ResolvedModel):
        return lambda: torch_pool(model, 1)


def trained_update(model: ResolvedModel, prompt: list[int], target: int) -> WeightUpdate:
    from plait.api import build

    trainer = build("trainer_engine", "torch", model, seed=0)
    try:
        for _ in range(2):
            trainer.forward_backward(
                [sft_datum([*prompt, target], [0.0] * (len(prompt) - 1) + [1.0])], "cross_entropy"
            )
            trainer.optim_step(AdamParams(learning_rate=5e-2))
        return WeightUpdate(trainer.weight_version, dict(trainer.export_weights()))
    finally:
        trainer.close()


GREEDY = SamplingParams(max_tokens=1, stop=[], temperature=0)


@pytest.mark.slow  # several service processes: with the slow tests (make check < 5 min)
def test_requests_spread_and_joining_replicas_get_the_newest_weights(
    tiny_model: ResolvedModel,
) -> None:
    vocab = vocab_size(tiny_model)
    prompt = random_tokens(8, 10, vocab)
    target = (prompt[-1] + 5) % vocab
    update = trained_update(tiny_model, prompt, target)

    async def body() -> None:
        pool = torch_pool(tiny_model, 2)
        try:
            replies = await asyncio.gather(
                *(
                    pool.sample(
                        ModelInput.from_ints(random_tokens(i, 6, vocab)),
                        1,
                        SamplingParams(max_tokens=8, stop=[]),
                    )
                    for i in range(8)
                )
            )
            assert all(len(r.sequences[0].tokens) == 8 for r in replies)
            assert all(r.requests > 0 for r in pool.replicas), [r.requests for r in pool.replicas]
            assert {r.sequences[0].replica for r in replies} == {
                r.name for r in pool.replicas
            }  # each names its replica
            await pool.apply_weights(update)
            await pool.scale(3)
            joined = pool.replicas[-1]
            seq = (await joined.engine.sample(ModelInput.from_ints(prompt), 1, GREEDY)).sequences[0]
            assert seq.tokens == (target,) and seq.weight_version == update.version
            assert pool.weight_version == update.version
            running = [
                asyncio.ensure_future(
                    pool.sample(
                        ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=64, stop=[])
                    )
                )
                for _ in range(6)
            ]
            await asyncio.sleep(0.05)
            await pool.scale(1)  # drains: the running requests finish
            assert all(len(r.sequences[0].tokens) == 64 for r in await asyncio.gather(*running))
            for _ in range(100):
                if len(pool.replicas) == 1:
                    break
                await asyncio.sleep(0.05)
            assert len(pool.replicas) == 1
            assert "1 of 1 replicas healthy" in (await pool.health()).detail
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(body(), 300))


def test_the_pool_scales_to_what_its_scale_file_says(tiny_model: ResolvedModel, tmp_path) -> None:
    scale_file = tmp_path / "scale.json"

    async def body() -> None:
        pool = torch_pool(tiny_model, 1, scale_file=str(scale_file), poll_s=0.1)
        try:
            await pool.sample(
                ModelInput.from_ints([1, 2, 3]), 1, SamplingParams(max_tokens=2, stop=[])
            )
            scale_file.write_text(json.dumps({"replicas": 2}))
            for _ in range(100):
                if len(pool.replicas) == 2:
                    break
                await asyncio.sleep(0.1)
            assert len(pool.replicas) == 2
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(body(), 300))


@pytest.mark.slow  # 14 s, killing and recovering: with the slow tests (make check < 5 min)
def test_a_dead_replicas_requests_go_to_another(tiny_model: ResolvedModel) -> None:
    """Two launched services that are never restarted (max_restarts 0): one is SIGKILLed while
    requests are held on it; they complete on the other, with the same (seeded) tokens, and the
    dead one leaves the pool."""
    from plait_remote.options import PoolOptions, ReplicaSpec
    from plait_remote.pool import PoolEngine

    replica = ReplicaSpec(
        "remote", {"engine": "torch", "max_restarts": 0, "startup_timeout_s": 300.0}, 2
    )
    params = SamplingParams(max_tokens=6, stop=[], seed=3)
    prompt = ModelInput.from_ints([5, 6, 7, 8])

    async def body() -> None:
        pool = PoolEngine(tiny_model, options=PoolOptions(replicas=[replica]), seed=0)
        try:
            expected = (await pool.sample(prompt, 2, params)).sequences
            doomed, survivor = pool.replicas
            await doomed.engine.http.request("POST", "/pause", json={"mode": "keep"})
            doomed.tokens_per_s, survivor.tokens_per_s = (
                1e9,
                1.0,
            )  # route the next requests to the doomed one
            running = [asyncio.ensure_future(pool.sample(prompt, 2, params)) for _ in range(2)]
            await asyncio.sleep(1.0)
            assert doomed.in_flight == 2
            os.kill(doomed.engine.server.pid, signal.SIGKILL)
            for reply in await asyncio.gather(*running):
                assert [s.tokens for s in reply.sequences] == [s.tokens for s in expected]
            assert pool.replicas == [survivor]
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(body(), 600))


@pytest.mark.slow
def test_the_pool_autoscales_by_the_requests_that_wait_for_room(tiny_model: ResolvedModel) -> None:
    from plait_remote.scale import AutoscaleOptions

    async def body() -> list[int]:
        pool = torch_pool(
            tiny_model,
            1,
            max_in_flight=1,
            poll_s=0.05,
            autoscale=AutoscaleOptions(min=1, max=3, stall_s=0.2, idle_s=0.5),
        )
        sizes = []
        try:
            running = asyncio.gather(
                *(
                    pool.sample(
                        ModelInput.from_ints([1, 2, 3, i]),
                        1,
                        SamplingParams(max_tokens=32, stop=[]),
                    )
                    for i in range(16)
                )
            )
            while not running.done():
                sizes.append(sum(not r.draining for r in pool.replicas))
                await asyncio.sleep(0.02)
            assert all(len(r.sequences[0].tokens) == 32 for r in await running)
            for _ in range(200):  # calm: it drains back to its minimum
                if len(pool.replicas) == 1:
                    break
                await asyncio.sleep(0.05)
            assert len(pool.replicas) == 1
            return sizes
        finally:
            await pool.close()

    sizes = asyncio.run(asyncio.wait_for(body(), 300))
    assert max(sizes) == 3 and sizes[0] == 1, sizes


def test_autoscale_decisions_and_settings(
    monkeypatch: pytest.MonkeyPatch, tiny_model: ResolvedModel
) -> None:
    from plait.api import ConfigError
    from plait_remote import scale
    from plait_remote.scale import AutoscaleOptions, Autoscaler

    clock = [100.0]
    monkeypatch.setattr(scale.time, "monotonic", lambda: clock[0])
    policy = Autoscaler(AutoscaleOptions(min=1, max=2, stall_s=1.0, idle_s=10.0), "test pool")
    clock[0] += 2
    assert policy.wanted(1, 1, cap=1) == 1  # nothing waits
    with policy.waiting():
        clock[0] += 0.5
        assert policy.wanted(1, 1, cap=1) == 1  # not waited for stall_s yet
        clock[0] += 0.6
        assert policy.wanted(1, 1, cap=1) == 2
        assert policy.wanted(2, 2, cap=1) == 2  # at max
    clock[0] += 5
    assert policy.wanted(2, 2, cap=1) == 2  # calm for 5 s of idle_s 10
    clock[0] += 6
    assert policy.wanted(2, 1, cap=1) == 2  # calm, but two were in flight within idle_s
    clock[0] += 5
    assert policy.wanted(2, 1, cap=1) == 1  # the last idle_s had at most one in flight
    assert policy.wanted(0, 0, cap=1) == 1  # below min (members died): back up at once
    with pytest.raises(ValueError, match="below min"):
        AutoscaleOptions(min=3, max=2)
    with pytest.raises(ConfigError, match="max_in_flight"):
        torch_pool(tiny_model, 1, autoscale=AutoscaleOptions())
    with pytest.raises(ConfigError, match="scale_file"):
        torch_pool(
            tiny_model, 1, max_in_flight=2, scale_file="x.json", autoscale=AutoscaleOptions()
        )
