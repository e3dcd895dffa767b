"""plait-sglang beyond the contract kit, on the fake SGLang server: pause modes and the cache
rule, weights by disk / version bump / gloo broadcast, LoRA, routed experts, version drift."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from plait.api import (
    AdamParams,
    EngineError,
    ModelInput,
    ResolvedModel,
    SamplingParams,
    WeightUpdate,
)
from plait_server.engine import free_port
from plait_server.testing import assert_resampled_as_before
from plait_testing.lora import merged_logprob, write_random_lora
from plait_testing.trainer import datum_logprobs, random_tokens, sft_datum
from plait_weights.broadcast import broadcast, open_group, tensor_metas
from plait_weights.capabilities import BroadcastGroup

pytestmark = pytest.mark.sglang
VOCAB = 151936
ATOL = 2e-3


@pytest.fixture
def trainer(tiny_model: ResolvedModel):
    from plait.api import build

    trainer = build("trainer_engine", "torch", tiny_model, seed=0)
    yield trainer
    trainer.close()


def train_towards(trainer, prompt: list[int], target: int, steps: int = 3) -> WeightUpdate:
    datum = sft_datum([*prompt, target], [0.0] * (len(prompt) - 1) + [1.0])
    for _ in range(steps):
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=1e-1))
    return WeightUpdate(trainer.weight_version, dict(trainer.export_weights()))


def last_logprob(trainer, tokens: list[int]) -> float:
    return float(datum_logprobs(trainer.forward([sft_datum(tokens)]))[0][-1])


async def greedy(engine, prompt: list[int], **kwargs):
    response = await engine.sample(
        ModelInput.from_ints(prompt),
        1,
        SamplingParams(max_tokens=1, stop=[], temperature=0),
        **kwargs,
    )
    return response.sequences[0]


def run(coro, timeout: float = 300):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_updates_flush_the_prefix_cache_which_otherwise_goes_stale(make_attached, trainer) -> None:
    """The fake reuses a prompt's KV from its prefix cache, as SGLang does. The plugin's update
    flushes it; an update that does not (flush_cache false) leaves logprobs of the old weights."""
    prompt = random_tokens(4, 12, VOCAB)

    async def body() -> None:
        engine = make_attached()
        try:
            await greedy(engine, prompt)  # fills the cache
            update = train_towards(trainer, prompt, (prompt[-1] + 5) % VOCAB)
            path = await engine._staging.stage(update)
            await engine.http.request(
                "POST",
                "/update_weights_from_disk",
                json={"model_path": str(path), "weight_version": "1", "flush_cache": False},
            )
            stale = await greedy(engine, prompt)
            expected = last_logprob(trainer, [*prompt, *stale.tokens])
            assert abs(stale.logprobs[0] - expected) > 0.1, (
                "without a flush the cached KV is the old weights'"
            )
            await engine.apply_weights(update)  # the plugin's update flushes
            fresh = await greedy(engine, prompt)
            assert fresh.token_versions == (update.version,)
            np.testing.assert_allclose(
                fresh.logprobs[0], last_logprob(trainer, [*prompt, *fresh.tokens]), atol=ATOL
            )
        finally:
            await engine.close()

    run(body())


@pytest.mark.parametrize("keep_mode", ["retract", "in_place"])
def test_keep_pause_modes_hold_requests_across_an_update(
    make_attached, trainer, keep_mode: str
) -> None:
    """retract re-prefills held requests with the new weights; in_place keeps their old KV and
    the update must not flush (SGLang refuses while requests are held in place)."""
    prompt = random_tokens(8, 6, VOCAB)

    async def body() -> None:
        engine = make_attached(keep_mode=keep_mode)
        try:
            long = asyncio.ensure_future(
                engine.sample(
                    ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=40, stop=[], seed=2)
                )
            )
            await engine.sample(
                ModelInput.from_ints(prompt[:3]), 1, SamplingParams(max_tokens=1, stop=[])
            )
            await engine.pause("keep")
            await asyncio.sleep(0.3)
            assert not long.done()
            await engine.apply_weights(train_towards(trainer, prompt, 7))
            await engine.resume()
            seq = (await long).sequences[0]
            versions = seq.versions()
            assert (
                len(seq.tokens) == 40
                and versions[0] == 0
                and versions[-1] == trainer.weight_version
            )
            assert list(versions) == sorted(versions)
        finally:
            await engine.close()

    run(body())


def test_wait_pause_lets_requests_finish_and_holds_new_ones(make_attached) -> None:
    async def body() -> None:
        engine = make_attached()
        try:
            long = asyncio.ensure_future(
                engine.sample(
                    ModelInput.from_ints([5, 6, 7]), 1, SamplingParams(max_tokens=20, stop=[])
                )
            )
            await asyncio.sleep(0.1)
            await engine.pause("wait")
            assert long.done() and len(long.result().sequences[0].tokens) == 20
            later = asyncio.ensure_future(
                engine.sample(ModelInput.from_ints([5]), 1, SamplingParams(max_tokens=2, stop=[]))
            )
            await asyncio.sleep(0.3)
            assert not later.done()
            await engine.resume()
            assert len((await later).sequences[0].tokens) == 2
        finally:
            await engine.close()

    run(body())


def test_version_bump_and_gloo_broadcast(make_attached, trainer) -> None:
    prompt = random_tokens(9, 7, VOCAB)

    async def body() -> None:
        engine = make_attached()
        try:
            before = await greedy(engine, prompt)
            await engine.apply_weights(WeightUpdate(5, {}))  # the version alone
            bumped = await greedy(engine, prompt)
            assert bumped.tokens == before.tokens and bumped.token_versions == (5,)
            ranks = await engine.weight_broadcast_ranks()
            group = BroadcastGroup(
                "127.0.0.1", free_port(), rank_offset=1, world_size=1 + ranks, backend="gloo"
            )
            pg, _ = await asyncio.gather(
                asyncio.to_thread(open_group, group, 0), engine.join_weight_broadcast(group)
            )
            target = (prompt[-1] + 9) % VOCAB
            tensors = train_towards(trainer, prompt, target).tensors
            await asyncio.gather(
                engine.receive_weight_broadcast(tensor_metas(tensors), 6),
                asyncio.to_thread(broadcast, pg, tensors),
            )
            after = await greedy(engine, prompt)
            assert (
                after.tokens == (target,)
                and after.token_versions == (6,)
                and engine.weight_version == 6
            )
            np.testing.assert_allclose(
                after.logprobs[0], last_logprob(trainer, [*prompt, target]), atol=ATOL
            )
            await engine.leave_weight_broadcast()
        finally:
            await engine.close()

    run(body())


def test_lora_adapters_load_sample_and_unload(
    make_attached, tiny_model: ResolvedModel, tmp_path: Path
) -> None:
    deltas = write_random_lora(tiny_model, tmp_path / "adapter")
    prompt = random_tokens(10, 8, VOCAB)

    async def body() -> None:
        engine = make_attached(enable_lora=True)
        try:
            base = await greedy(engine, prompt)
            await engine.load_lora_adapter("a1", str(tmp_path / "adapter"))
            adapted = await greedy(engine, prompt, lora="a1")
            expected = merged_logprob(tiny_model, deltas, [*prompt, *adapted.tokens])
            np.testing.assert_allclose(adapted.logprobs[0], expected, atol=ATOL)
            assert adapted.logprobs != base.logprobs
            again = await greedy(engine, prompt)  # without the adapter: the base model
            np.testing.assert_allclose(again.logprobs, base.logprobs, atol=1e-5)
            await engine.unload_lora_adapter("a1")
            with pytest.raises(EngineError, match="a1"):
                await engine.unload_lora_adapter("a1")
        finally:
            await engine.close()

    run(body())


def build_tiny_moe(dest: Path) -> ResolvedModel:
    """A random 2-layer Qwen3-MoE (8 experts, 2 per token), with the tiny Qwen3's tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(str(dest))
    return ResolvedModel("tiny-moe", dest, dest)


def expected_routing(model: ResolvedModel, tokens: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=torch.float32)
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    top_k = hf.config.num_experts_per_tok
    return torch.stack(
        [r.reshape(len(tokens), -1).topk(top_k, -1).indices for r in out.router_logits], 1
    ).numpy()


@pytest.mark.parametrize("version", ["0.5.23", "0.5.6"])
def test_routed_experts_decode_or_a_clear_error(
    tiny_model: ResolvedModel, tmp_path: Path, version: str, fake_options
) -> None:
    """R3: SGLang's raw int32 routing, one (layers x top-k) row per forwarded position; a server
    from before R3 (0.5.6) is a clear error."""
    moe = build_tiny_moe(tmp_path / "moe")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (moe.path / name).write_bytes((Path(tiny_model.path) / name).read_bytes())
    from plait_sglang.engine import SGLangEngine

    prompt = random_tokens(11, 5, VOCAB)

    async def body() -> None:
        engine = SGLangEngine(
            moe,
            options=fake_options(
                enable_return_routed_experts=True, server_args=["--fake-version", version]
            ),
            seed=0,
        )
        try:
            if version == "0.5.6":
                with pytest.raises(EngineError, match="routed_experts"):
                    await engine.sample(
                        ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=4, stop=[])
                    )
                return
            seq = (
                await engine.sample(
                    ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=4, stop=[], seed=1)
                )
            ).sequences[0]
            assert (
                seq.routed_experts.dtype == "uint8"
            )  # 8 experts: the narrowest dtype, not the wire's int32
            routed = seq.routed_experts.to_numpy()
            assert routed.shape == (len(prompt) + 4 - 1, 2, 2) and routed.dtype == np.uint8
            np.testing.assert_array_equal(
                routed, expected_routing(moe, [*prompt, *seq.tokens])[:-1]
            )
        finally:
            await engine.close()

    run(body())


def test_older_wire_without_version_spans(tiny_model: ResolvedModel, trainer, fake_options) -> None:
    """SGLang 0.5.15 reports one weight_version per reply (no per-token spans) and has no
    contract gate; sampling, updates and version tags still work."""
    from plait_sglang.engine import SGLangEngine

    prompt = random_tokens(12, 6, VOCAB)

    async def body() -> None:
        engine = SGLangEngine(
            tiny_model, options=fake_options(server_args=["--fake-version", "0.5.15"]), seed=0
        )
        try:
            first = await greedy(engine, prompt)
            assert first.token_versions == (0,)
            target = (prompt[-1] + 3) % VOCAB
            await engine.apply_weights(train_towards(trainer, prompt, target))
            after = await greedy(engine, prompt)
            assert after.tokens == (target,) and after.token_versions == (trainer.weight_version,)
        finally:
            await engine.close()

    run(body())


def test_disk_sync_writes_once_and_engines_load_from_disk(
    make_attached, trainer, tmp_path: Path
) -> None:
    """The core's "disk" weight sync: safetensors per version under its directory, loaded by the
    engine's own disk endpoint; old versions pruned."""
    from plait_weights.sync import DiskSync, DiskSyncOptions

    sync = DiskSync(options=DiskSyncOptions(directory=str(tmp_path / "weights"), keep=2))

    async def body() -> None:
        engine = make_attached()
        pushed = []
        try:
            for step in range(3):
                prompt = random_tokens(13 + step, 6, VOCAB)
                target = (prompt[-1] + 21) % VOCAB
                train_towards(trainer, prompt, target)
                stats = await sync.push(trainer, [engine], trainer.weight_version)
                pushed.append(f"v{stats.version}")
                assert (
                    stats.version == trainer.weight_version == engine.weight_version
                    and stats.bytes > 0
                )
                after = await greedy(engine, prompt)
                assert after.token_versions == (trainer.weight_version,)
                np.testing.assert_allclose(
                    after.logprobs[0], last_logprob(trainer, [*prompt, *after.tokens]), atol=ATOL
                )
            assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == sorted(pushed[-2:])
        finally:
            await engine.close()

    run(body())


def test_launched_server_health_wait_and_crash(tiny_model: ResolvedModel, fake_options) -> None:
    """A launched server answers 503 while starting (the engine waits); when it dies later and
    may not be restarted (max_restarts 0), the next request names its exit code instead of
    hanging."""
    from plait_sglang.engine import SGLangEngine

    async def body() -> None:
        engine = SGLangEngine(
            tiny_model,
            options=fake_options(server_args=["--startup-delay", "2"], max_restarts=0),
            seed=0,
        )
        try:
            health = await engine.health()
            assert not health.ok  # still starting
            await greedy(engine, [1, 2, 3])
            assert (await engine.health()).ok
            os.killpg(engine.server.pid, signal.SIGKILL)
            engine.server.process.wait(10)
            with pytest.raises(EngineError, match=r"exited with code -9"):
                await greedy(engine, [1, 2, 3])
            assert "exited" in (await engine.health()).detail
        finally:
            await engine.close()

    run(body())


def test_a_server_killed_mid_request_is_restarted_with_its_weights(
    tiny_model: ResolvedModel, trainer, fake_options, tmp_path: Path
) -> None:
    """Issue 17, item 18: a launched server that dies must not end the run. The server is
    SIGKILLed while requests run on it (held there by a server-side pause); they complete on a
    restarted server that has the weights the dead one had: the same tokens and logprobs as
    before the kill, labelled with the update's version, and the trainer's logprobs."""
    from plait_sglang.engine import SGLangEngine

    prompt = random_tokens(8, 10, VOCAB)
    params = SamplingParams(max_tokens=4, stop=[], seed=3)

    async def body() -> None:
        engine = SGLangEngine(
            tiny_model, options=fake_options(log_path=str(tmp_path / "server.log")), seed=0
        )
        try:
            untrained = await greedy(engine, prompt)
            update = train_towards(trainer, prompt, (prompt[-1] + 5) % VOCAB)
            await engine.apply_weights(update)
            before = (await engine.sample(ModelInput.from_ints(prompt), 2, params)).sequences
            await engine.http.request("POST", "/pause_generation", json={"mode": "retract"})
            running = [
                asyncio.ensure_future(engine.sample(ModelInput.from_ints(prompt), 2, params))
                for _ in range(3)
            ]
            await asyncio.sleep(1.0)  # the requests reach the server and wait there
            dead = engine.server.pid
            os.killpg(dead, signal.SIGKILL)
            replies = await asyncio.gather(*running)
            assert (
                engine.restarts == 1
                and engine.server.pid != dead
                and engine.weight_version == update.version
            )
            assert_resampled_as_before(replies, before, update.version, atol=1e-5)
            after = await greedy(engine, prompt)
            assert after.logprobs != untrained.logprobs, (
                "the restarted server must not serve the checkpoint"
            )
            np.testing.assert_allclose(
                after.logprobs[0], last_logprob(trainer, [*prompt, *after.tokens]), atol=ATOL
            )
        finally:
            await engine.close()

    run(body())
