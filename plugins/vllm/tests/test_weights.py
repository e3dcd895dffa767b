"""Weight updates on a real vLLM server: by disk, by the distributed API over gloo, by version
bump; the prefix-cache rule; the logprob match with the trainer after every sync of a short
GRPO run."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import structlog

from plait.api import (
    AdamParams,
    AdvantageBatch,
    ModelInput,
    ResolvedModel,
    SamplingParams,
    WeightUpdate,
)
from plait_algorithms.advantages import grpo
from plait_testing.trainer import datum_logprobs, random_tokens, rl_datum, sft_datum
from plait_weights.broadcast import broadcast, open_group, tensor_metas
from plait_weights.capabilities import BroadcastGroup
from plait_weights.sync import InProcessSync

pytestmark = pytest.mark.vllm
log = structlog.get_logger("test_weights")

ATOL = 2e-3
VOCAB = 151936


@pytest.fixture
def engine(make_attached):
    return make_attached


@pytest.fixture
def trainer(tiny_model: ResolvedModel):
    from plait.api import build

    trainer = build("trainer_engine", "torch", tiny_model, seed=0)
    yield trainer
    trainer.close()


def train_towards(trainer, prompt: list[int], target: int, steps: int = 2) -> None:
    datum = sft_datum([*prompt, target], [0.0] * (len(prompt) - 1) + [1.0])
    for _ in range(steps):
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=5e-2))


def trainer_logprobs(trainer, tokens: list[int]) -> np.ndarray:
    return datum_logprobs(trainer.forward([sft_datum(tokens)]))[0]


async def greedy_step(engine, prompt: list[int]):
    response = await engine.sample(
        ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=1, stop=[], temperature=0)
    )
    return response.sequences[0]


@pytest.mark.parametrize("salt", [True, False], ids=["salted-cache", "reset-cache"])
def test_update_by_disk_never_reuses_stale_prefix_cache(engine, trainer, salt: bool) -> None:
    """A 48-token prompt fills whole KV blocks, which vLLM caches by prefix. After an update the
    engine must not reuse them: its logprob of the next token is the new weights'."""
    prompt = random_tokens(5, 48, VOCAB)

    async def body() -> None:
        eng = engine(salt_cache_by_version=salt)
        try:
            first = await greedy_step(eng, prompt)
            cached = await greedy_step(eng, prompt)  # served from the prefix cache
            assert cached.tokens == first.tokens
            train_towards(trainer, prompt, (prompt[-1] + 3) % VOCAB)
            await eng.apply_weights(
                WeightUpdate(trainer.weight_version, dict(trainer.export_weights()))
            )
            after = await greedy_step(eng, prompt)
            assert after.token_versions == (trainer.weight_version,)
            expected = trainer_logprobs(trainer, [*prompt, *after.tokens])[-1]
            np.testing.assert_allclose(after.logprobs[0], expected, atol=ATOL)
        finally:
            await eng.close()

    asyncio.run(asyncio.wait_for(body(), 300))


def test_update_over_gloo_broadcast(engine, trainer) -> None:
    """vLLM's native distributed update API (init / start / update / finish), with the trainer
    broadcasting over a real gloo group, as the broadcast weight syncs do."""
    from plait_server.engine import free_port

    prompt = random_tokens(6, 9, VOCAB)

    async def body() -> None:
        eng = engine()
        try:
            ranks = await eng.weight_broadcast_ranks()
            group = BroadcastGroup(
                "127.0.0.1", free_port(), rank_offset=1, world_size=1 + ranks, backend="gloo"
            )
            pg, _ = await asyncio.gather(
                asyncio.to_thread(open_group, group, 0), eng.join_weight_broadcast(group)
            )
            for step in range(2):
                train_towards(trainer, prompt, (prompt[-1] + 11 + step) % VOCAB)
                tensors = dict(trainer.export_weights())
                await asyncio.gather(
                    eng.receive_weight_broadcast(tensor_metas(tensors), trainer.weight_version),
                    asyncio.to_thread(broadcast, pg, tensors),
                )
                assert eng.weight_version == trainer.weight_version
                after = await greedy_step(eng, prompt)
                assert after.tokens == ((prompt[-1] + 11 + step) % VOCAB,)
                assert after.token_versions == (trainer.weight_version,)
                expected = trainer_logprobs(trainer, [*prompt, *after.tokens])[-1]
                np.testing.assert_allclose(after.logprobs[0], expected, atol=ATOL)
            await eng.leave_weight_broadcast()
        finally:
            await eng.close()

    asyncio.run(asyncio.wait_for(body(), 300))


def test_version_bump_relabels_without_changing_weights(engine) -> None:
    prompt = random_tokens(7, 6, VOCAB)

    async def body() -> None:
        eng = engine()
        try:
            params = SamplingParams(max_tokens=4, stop=[], seed=3)
            before = (await eng.sample(ModelInput.from_ints(prompt), 1, params)).sequences[0]
            await eng.apply_weights(WeightUpdate(7, {}))  # no tensors: the version alone
            assert eng.weight_version == 7 and (await eng.health()).weight_version == 7
            after = (await eng.sample(ModelInput.from_ints(prompt), 1, params)).sequences[0]
            assert after.tokens == before.tokens
            np.testing.assert_allclose(after.logprobs, before.logprobs, atol=1e-5)
            assert before.versions() == (0,) * 4 and after.versions() == (7,) * 4
        finally:
            await eng.close()

    asyncio.run(asyncio.wait_for(body(), 300))


def test_grpo_engine_logprobs_track_the_trainer_after_every_sync(engine, trainer) -> None:
    """A short GRPO run (importance-sampling loss, group advantages, weight sync every step).
    The reward (the share of sampled tokens with an even id) is arbitrary but learnable; what
    is checked is that after each sync the engine's logprobs of a fixed sequence match the
    trainer's, and that the sampled tokens' logprobs stay close to the trainer's (mismatch KL)."""
    prompts = [random_tokens(20 + i, 6, VOCAB) for i in range(2)]
    fixed = random_tokens(99, 24, VOCAB)
    group_size, max_tokens = 4, 6

    async def body() -> list[float]:
        eng = engine()
        sync = InProcessSync()
        kls = []
        try:
            for step in range(3):
                datums, sampled_lp, trained_lp = [], [], []
                for i, prompt in enumerate(prompts):
                    response = await eng.sample(
                        ModelInput.from_ints(prompt),
                        group_size,
                        SamplingParams(max_tokens=max_tokens, stop=[], seed=1000 * step + i),
                    )
                    rewards = [
                        float(np.mean([t % 2 == 0 for t in s.tokens])) for s in response.sequences
                    ]
                    batch = AdvantageBatch([np.asarray(rewards)], [np.full(group_size, max_tokens)])
                    for seq, advantage in zip(response.sequences, grpo(batch)[0], strict=True):
                        assert seq.versions() == (trainer.weight_version,) * max_tokens
                        datums.append(
                            rl_datum(
                                [*prompt, *seq.tokens],
                                len(prompt),
                                seq.logprobs,
                                float(advantage[0]),
                            )
                        )
                        sampled_lp.extend(seq.logprobs)
                        trained_lp.extend(
                            trainer_logprobs(trainer, [*prompt, *seq.tokens])[-max_tokens:]
                        )
                diff = np.asarray(trained_lp) - np.asarray(sampled_lp)
                kls.append(
                    float(np.mean(np.expm1(diff) - diff))
                )  # k3 estimate of KL(sampler || trainer)
                trainer.forward_backward(datums, "importance_sampling")
                trainer.optim_step(AdamParams(learning_rate=3e-2))
                await sync.push(trainer, [eng], trainer.weight_version)
                engine_lp = await eng.compute_logprobs(ModelInput.from_ints(fixed))
                expected = trainer_logprobs(trainer, fixed)
                mismatch = np.abs(np.asarray(engine_lp[1:]) - expected).max()
                log.info(
                    "grpo step",
                    step=step,
                    version=eng.weight_version,
                    fixed_seq_max_abs_diff=float(mismatch),
                    sampled_mismatch_kl=kls[-1],
                )
                assert eng.weight_version == trainer.weight_version == step + 1
                np.testing.assert_allclose(engine_lp[1:], expected, atol=ATOL)
            return kls
        finally:
            await eng.close()

    kls = asyncio.run(asyncio.wait_for(body(), 600))
    assert all(math.isfinite(k) and abs(k) < 1e-4 for k in kls), kls
