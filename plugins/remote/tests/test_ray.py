"""The "remote" engines with `ray` set: their services placed on the nodes of a real two-node Ray
cluster on this machine by custom resources, weights moving from the trainer's node to the
sampler's and to a service outside the cluster, a request no node can take refused with what it
asked for, another cluster refused, a service that dies on its node (SIGKILL, or its actor
killed) launched again with its weights, or named with its actor and node when it may not be,
and a pool of replicas on Ray."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from plait.api import (
    AdamParams,
    EngineError,
    ModelInput,
    ResolvedModel,
    SamplingParams,
    WeightUpdate,
)
from plait_testing.trainer import random_tokens, sft_datum, vocab_size

pytestmark = pytest.mark.slow

TRAINER_NODE, INFERENCE_NODE = {"trainer_pool": 1.0}, {"inference_pool": 1.0}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from plait_testing.ray import local_cluster

    with local_cluster([TRAINER_NODE, INFERENCE_NODE]) as cluster:
        yield cluster


def node_with(resource: str) -> str:
    import ray

    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return str(node)


def placement(resources: dict[str, float]) -> Any:
    from plait_remote.options import RayPlacement

    return RayPlacement(resources=resources)


def test_services_run_on_the_nodes_their_resources_name_and_weights_cross_over(
    cluster: Any, tiny_model: ResolvedModel, remote_options, remote_trainer_options, make_attached
) -> None:
    """The trainer on one node, an inference service on another and one reached over HTTP outside
    the cluster: the trained weights reach both."""
    from plait_remote.engine import RemoteEngine
    from plait_remote.trainer import RemoteTrainer

    vocab = vocab_size(tiny_model)
    prompt = random_tokens(8, 11, vocab)
    target = (prompt[-1] + 7) % vocab
    trainer = RemoteTrainer(
        tiny_model, options=remote_trainer_options(ray=placement(TRAINER_NODE)), seed=0
    )
    try:
        assert trainer.server.node_id == node_with("trainer_pool")
        assert trainer.options.api_key and trainer.server.url == trainer.base_url
        for _ in range(2):
            trainer.forward_backward(
                [sft_datum([*prompt, target], [0.0] * (len(prompt) - 1) + [1.0])], "cross_entropy"
            )
            trainer.optim_step(AdamParams(learning_rate=5e-2))
        update = WeightUpdate(trainer.weight_version, dict(trainer.export_weights()))
    finally:
        trainer.close()

    async def body() -> None:
        engine = RemoteEngine(
            tiny_model, options=remote_options(ray=placement(INFERENCE_NODE)), seed=0
        )
        try:
            assert engine.server.node_id == node_with("inference_pool")
            await engine.apply_weights(update)
            greedy = await engine.sample(
                ModelInput.from_ints(prompt),
                1,
                SamplingParams(max_tokens=1, stop=[], temperature=0),
            )
            assert (
                greedy.sequences[0].tokens == (target,) and engine.weight_version == update.version
            )
            health = await engine.health()
            assert health.ok, health.detail
        finally:
            await engine.close()
        outside = make_attached()
        try:
            await outside.apply_weights(update)
            greedy = await outside.sample(
                ModelInput.from_ints(prompt),
                1,
                SamplingParams(max_tokens=1, stop=[], temperature=0),
            )
            assert greedy.sequences[0].tokens == (target,)
        finally:
            await outside.close()

    asyncio.run(asyncio.wait_for(body(), 600))


def test_a_request_no_node_can_take_fails_with_what_it_asked_for(
    cluster: Any, tiny_model: ResolvedModel, remote_options
) -> None:
    from plait_remote.engine import RemoteEngine

    with pytest.raises(EngineError) as info:
        RemoteEngine(
            tiny_model,
            options=remote_options(ray=placement({"gpu_pool": 1.0}), startup_timeout_s=5.0),
        )
    assert (
        "no node of the Ray cluster took" in info.value.message and "gpu_pool" in info.value.message
    )
    assert "inference_pool" in info.value.message  # what the cluster has
    assert info.value.fix


def test_a_service_on_another_ray_cluster_is_refused_with_the_way_to_reach_it(
    cluster: Any, tiny_model: ResolvedModel, remote_options
) -> None:
    from plait_remote.engine import RemoteEngine
    from plait_remote.options import RayPlacement

    with pytest.raises(EngineError, match="joins one Ray cluster") as info:
        RemoteEngine(tiny_model, options=remote_options(ray=RayPlacement(address="10.9.8.7:6379")))
    assert "options.url" in info.value.fix


def test_a_service_killed_on_its_node_is_launched_again_there_with_its_weights(
    cluster: Any, tiny_model: ResolvedModel, remote_options
) -> None:
    """SIGKILL of the service process, then its actor killed: each time the engine launches it
    again on a node with the resource, with the weights it had; without restarts left, the
    failure names the actor and the node."""
    import ray

    from plait.api import build
    from plait_remote.engine import RemoteEngine

    vocab = vocab_size(tiny_model)
    prompt = random_tokens(8, 12, vocab)
    params = SamplingParams(max_tokens=5, stop=[], seed=4)
    trainer = build("trainer_engine", "torch", tiny_model, seed=0)
    trainer.forward_backward(
        [sft_datum([*prompt, 5], [0.0] * (len(prompt) - 1) + [1.0])], "cross_entropy"
    )
    trainer.optim_step(AdamParams(learning_rate=5e-2))
    update = WeightUpdate(trainer.weight_version, dict(trainer.export_weights()))
    trainer.close()

    async def body() -> None:
        engine = RemoteEngine(
            tiny_model,
            options=remote_options(ray=placement(INFERENCE_NODE), max_restarts=2),
            seed=0,
        )
        try:
            await engine.apply_weights(update)
            before = (await engine.sample(ModelInput.from_ints(prompt), 2, params)).sequences
            os.kill(engine.server.pid, signal.SIGKILL)  # the node is this machine
            await asyncio.sleep(1.0)
            again = (await engine.sample(ModelInput.from_ints(prompt), 2, params)).sequences
            assert engine.restarts == 1 and [s.tokens for s in again] == [s.tokens for s in before]
            ray.kill(engine.server.actor)
            await asyncio.sleep(1.0)
            again = (await engine.sample(ModelInput.from_ints(prompt), 2, params)).sequences
            assert engine.restarts == 2 and [s.tokens for s in again] == [s.tokens for s in before]
            assert (
                engine.server.node_id == node_with("inference_pool")
                and engine.weight_version == update.version
            )
            killed = engine.server
            ray.kill(killed.actor)
            await asyncio.sleep(1.0)
            with pytest.raises(EngineError) as info:
                await engine.sample(ModelInput.from_ints(prompt), 1, params)
            assert "after 2 restarts" in info.value.message
            assert (
                killed.actor_id[:12] in info.value.message
                and killed.node_id[:12] in info.value.message
            )
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 600))


def test_a_pool_places_its_replicas_on_ray(cluster: Any, tiny_model: ResolvedModel) -> None:
    """Two replicas of half a CPU and half the resource each, on the one node with it, both
    serving."""
    from plait_remote.options import PoolOptions, ReplicaSpec
    from plait_remote.pool import PoolEngine

    on_ray = {
        "engine": "torch",
        "startup_timeout_s": 300.0,
        "ray": {"num_cpus": 0.5, "resources": {"inference_pool": 0.5}},
    }
    pool = PoolEngine(
        tiny_model, options=PoolOptions(replicas=[ReplicaSpec("remote", on_ray, 2)]), seed=0
    )

    async def body() -> None:
        try:
            prompts = [
                ModelInput.from_ints(random_tokens(seed, 6, vocab_size(tiny_model)))
                for seed in range(8)
            ]
            replies = await asyncio.gather(
                *(pool.sample(p, 1, SamplingParams(max_tokens=8, stop=[])) for p in prompts)
            )
            assert all(len(r.sequences[0].tokens) == 8 for r in replies)
            assert [r.engine.server.node_id for r in pool.replicas] == [
                node_with("inference_pool")
            ] * 2
            assert all(r.requests > 0 for r in pool.replicas), [r.requests for r in pool.replicas]
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(body(), 600))


def test_an_environment_pool_places_its_members_on_ray(cluster: Any) -> None:
    """Members of the environment pool on the node with the resource, behind an API key."""
    from plait_remote.env_pool import EnvPool
    from plait_remote.options import EnvPoolOptions, RayPlacement

    pool = EnvPool(
        EnvPoolOptions(
            env="math.arith",
            env_options={"preset": "tiny"},
            members=1,
            ray=RayPlacement(num_cpus=0.5, resources={"trainer_pool": 0.5}),
        )
    )

    async def body() -> None:
        try:
            task = await pool.get_task("train", 3)
            session = await pool.open(task)
            reply = await session.call(
                (await session.terminal_tool()).name, {"text": str(task["answer"])}
            )
            await session.close()
            assert reply.reward == 1.0, reply
            assert pool.members[0].server.node_id == node_with("trainer_pool")
            import httpx

            async with httpx.AsyncClient(base_url=pool.members[0].env.url) as client:
                assert (
                    await client.post("/create_session", json={})
                ).status_code == 401  # no key, no session
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(body(), 300))
