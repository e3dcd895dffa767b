"""The core's weight syncs between a real trainer and real engines (tiny-qwen3, bfloat16 served
from float32 master weights): deltas are bit-identical and small; fallbacks are loud and correct."""

from __future__ import annotations

import asyncio
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

from plait.api import (
    AdamParams,
    ModelInput,
    ResolvedModel,
    SamplingParams,
    WeightSyncError,
    WeightUpdate,
)
from plait_testing.trainer import rl_datum
from plait_torch.inference import TorchInferenceEngine
from plait_torch.trainer import TorchTrainer
from plait_weights import patch as weight_patch
from plait_weights.sync import (
    DiskSync,
    DiskSyncOptions,
    InProcessSync,
    InProcessSyncOptions,
    apply_patch_to_checkpoint,
)


@pytest.fixture(scope="module")
def bf16_model(tiny_model: ResolvedModel) -> ResolvedModel:
    return attrs.evolve(tiny_model, dtype="bfloat16")


@pytest.fixture(scope="module")
def trainer(bf16_model: ResolvedModel) -> TorchTrainer:
    trainer = TorchTrainer(bf16_model, seed=0)
    yield trainer
    trainer.close()


def rl_step(trainer: TorchTrainer, seed: int, learning_rate: float = 1e-6) -> None:
    rng = np.random.default_rng(seed)
    data = [
        rl_datum(rng.integers(0, 1000, 12).tolist(), 6, [-2.0] * 6, float(rng.normal()))
        for _ in range(4)
    ]
    trainer.forward_backward(data, "importance_sampling")
    trainer.optim_step(AdamParams(learning_rate=learning_rate))


def served(trainer: TorchTrainer) -> str:
    """Checksum of the trainer's weights as a bfloat16 engine must hold them."""
    return weight_patch.checksum((n, t.to(torch.bfloat16)) for n, t in trainer.export_weights())


def held(engine: TorchInferenceEngine) -> str:
    return weight_patch.checksum(engine.model.named_parameters())


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(
    "bucket_mb", [256.0, 0.05]
)  # one update per push, or dozens (later ones after earlier ones applied)
def test_delta_sync_is_bit_identical_and_sends_a_few_percent(trainer, bf16_model, bucket_mb):
    engine = TorchInferenceEngine(bf16_model, seed=0)
    sync = InProcessSync(
        options=InProcessSyncOptions(payload="delta", dtype="bfloat16", bucket_mb=bucket_mb)
    )

    async def body() -> list:
        stats = [await sync.push(trainer, [engine], trainer.weight_version)]
        for step in range(3):
            rl_step(trainer, step)
            stats.append(await sync.push(trainer, [engine], trainer.weight_version))
            assert held(engine) == served(trainer), f"engine drifted at step {step}"
            assert engine.weight_version == trainer.weight_version
        await engine.close()
        return stats

    first, *deltas = run(body())
    assert first.bytes == first.full_bytes and first.delta_fraction == 1.0
    for stats in deltas:
        assert 0 < stats.delta_fraction < 0.1, stats
        # bit steps: one byte of gap and one of step per changed bfloat16 element (two bytes), so
        # the bytes sent are the fraction of elements sent (a tensor sending values would cost
        # 1.5x)
        assert 0 < stats.bytes <= 1.02 * stats.delta_fraction * stats.full_bytes, stats


def test_an_engine_that_missed_a_version_gets_full_weights(trainer, bf16_model):
    behind, current = (
        TorchInferenceEngine(bf16_model, seed=0),
        TorchInferenceEngine(bf16_model, seed=0),
    )
    sync = InProcessSync(options=InProcessSyncOptions(payload="delta", dtype="bfloat16"))

    async def body() -> None:
        await sync.push(trainer, [behind, current], trainer.weight_version)
        rl_step(trainer, 10)
        await sync.push(trainer, [current], trainer.weight_version)  # `behind` misses this version
        rl_step(trainer, 11)
        # a corrupted engine: same version, other bits -> the delta's checksum fails, full weights
        # follow
        with torch.no_grad():
            next(current.model.parameters()).view(-1)[0] += 1
        stats = await sync.push(trainer, [behind, current], trainer.weight_version)
        assert held(behind) == held(current) == served(trainer)
        assert (
            stats.bytes > stats.full_bytes / 2
        )  # one full push (behind) plus delta+full (current)
        await behind.close()
        await current.close()

    run(body())


def test_bucketed_pushes_every_tensor_in_bounded_updates(trainer, bf16_model):
    engine = TorchInferenceEngine(bf16_model, seed=0)
    sync = InProcessSync(
        options=InProcessSyncOptions(
            payload="bucketed", dtype="bfloat16", bucket_mb=0.1, checksum=True
        )
    )
    applied: list[WeightUpdate] = []
    original = engine.apply_weights

    async def recording(update: WeightUpdate) -> None:
        applied.append(update)
        await original(update)

    engine.apply_weights = recording  # type: ignore[method-assign]

    async def body() -> None:
        rl_step(trainer, 20)
        stats = await sync.push(trainer, [engine], trainer.weight_version)
        assert held(engine) == served(trainer) and stats.bytes == stats.full_bytes
        await engine.close()

    run(body())
    assert len(applied) > 3 and all(
        u.version == trainer.weight_version and u.checksum for u in applied
    )
    biggest = max(t.numel() * 2 for t in engine.model.parameters())
    assert all(weight_patch.update_nbytes(u) <= max(0.1 * 2**20, biggest) for u in applied)


class DiskLoadingEngine(TorchInferenceEngine):
    """A torch engine that also loads weights from a directory, as server engines do
    (`plait_weights.capabilities.DiskWeightLoader`): the disk sync then hands it whole
    checkpoints."""

    loaded: list[str]

    async def load_weights_from_disk(self, path: str, version: int) -> None:
        from safetensors.torch import load_file

        self.loaded.append(path)
        tensors = load_file(str(Path(path) / "model.safetensors"))
        await self.apply_weights(WeightUpdate(version, tensors))

    async def set_weight_version(self, version: int) -> None:
        await self.apply_weights(WeightUpdate(version, {}))


def test_disk_delta_patches_files_and_receiver_checkpoints(trainer, bf16_model, tmp_path):
    plain = TorchInferenceEngine(bf16_model, seed=0)
    loader = DiskLoadingEngine(bf16_model, seed=0)
    loader.loaded = []
    sync = DiskSync(
        options=DiskSyncOptions(directory=str(tmp_path / "w"), payload="delta", dtype="bfloat16")
    )

    async def body() -> list:
        stats = [await sync.push(trainer, [plain, loader], trainer.weight_version)]
        for step in range(2):
            rl_step(trainer, 30 + step)
            stats.append(await sync.push(trainer, [plain, loader], trainer.weight_version))
            assert held(plain) == held(loader) == served(trainer)
        await plain.close()
        await loader.close()
        await sync.close()  # old versions are pruned in the background until then
        return stats

    stats = run(body())
    version = trainer.weight_version
    files = sorted(p.name for p in (tmp_path / "w" / f"v{version}").iterdir())
    assert files == ["patch-0000.safetensors", "update.json"]
    assert sorted(p.name for p in (tmp_path / "w").glob("v*")) == [f"v{version - 1}", f"v{version}"]
    assert all(Path(p).parent.name == "receivers" for p in loader.loaded)
    assert stats[-1].bytes < 0.15 * stats[-1].full_bytes
    # a receiver checkpoint must hold the version (and bits) a patch was made against
    receiver = sync.receiver_dir(1)
    with pytest.raises(
        WeightSyncError, match=f"other bits than the receiver, which holds version {version}"
    ):
        apply_patch_to_checkpoint(tmp_path / "w" / f"v{version}", receiver)  # the same patch twice
    with pytest.raises(WeightSyncError, match="no checkpoint"):
        apply_patch_to_checkpoint(tmp_path / "w" / f"v{version}", tmp_path / "empty")


def test_wrong_wire_dtype_is_named(trainer, bf16_model):
    engine = TorchInferenceEngine(bf16_model, seed=0)
    sync = InProcessSync(
        options=InProcessSyncOptions(payload="delta")
    )  # float32 deltas for a bfloat16 engine

    async def body() -> None:
        with pytest.raises(
            WeightSyncError, match=r"checksum(.|\n)*sync.options.dtype .*\(bfloat16\)"
        ):
            await sync.push(trainer, [engine], trainer.weight_version)
        await engine.close()

    run(body())


def test_weights_change_under_requests_in_flight(trainer, bf16_model):
    """pause("keep") -> delta push -> resume: the partial sequence continues, its later tokens
    tagged with the new version."""
    engine = TorchInferenceEngine(bf16_model, seed=0)
    sync = InProcessSync(options=InProcessSyncOptions(payload="delta", dtype="bfloat16"))
    prompt = ModelInput.from_ints([1, 2, 3, 4])

    async def body() -> None:
        await sync.push(trainer, [engine], trainer.weight_version)
        old = engine.weight_version
        request = asyncio.create_task(
            engine.sample(prompt, 2, SamplingParams(max_tokens=40, stop=[], seed=3))
        )
        while not engine._batch_active:  # decoding has begun
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await engine.pause("keep")
        rl_step(trainer, 50)
        await sync.push(trainer, [engine], trainer.weight_version)
        await engine.resume()
        for sequence in (await request).sequences:
            versions = sequence.versions()
            assert (
                len(versions) == 40
                and versions[0] == old
                and versions[-1] == trainer.weight_version
            )
            assert list(versions) == sorted(versions)
        await engine.close()

    run(body())


@pytest.mark.slow
def test_delta_sync_of_a_50m_model_after_adam_steps(tiny_model, tmp_path):
    """~56M parameters, float32 master weights served in bfloat16, RL steps at lr 1e-6: after
    Adam's first step (which moves every element by lr) a delta push costs at most 5% of a full
    one, and the engine always ends bit-identical to the trainer."""
    from plait_testing.models import build_resized_qwen3

    model = build_resized_qwen3(
        tiny_model.path,
        tmp_path / "qwen3-50m",
        hidden_size=320,
        intermediate_size=960,
        num_hidden_layers=6,
        num_attention_heads=10,
        num_key_value_heads=5,
        head_dim=32,
    )
    trainer = TorchTrainer(model, seed=0)
    assert 45e6 < sum(t.numel() for _, t in trainer.export_weights()) < 60e6
    engine = TorchInferenceEngine(attrs.evolve(model, dtype="bfloat16"), seed=0)
    sync = InProcessSync(options=InProcessSyncOptions(payload="delta", dtype="bfloat16"))

    async def body() -> list:
        stats = [await sync.push(trainer, [engine], trainer.weight_version)]
        for step in range(4):
            rl_step(trainer, step)
            stats.append(await sync.push(trainer, [engine], trainer.weight_version))
            assert held(engine) == served(trainer), f"engine drifted at step {step}"
        await engine.close()
        return stats

    try:
        full, first, *later = run(body())
    finally:
        trainer.close()
    assert full.bytes == full.full_bytes
    assert first.bytes < 0.15 * first.full_bytes, first
    for stats in later:
        assert 0 < stats.bytes <= 0.05 * stats.full_bytes, stats


def test_an_aborted_sequence_is_continued_under_the_new_weights(trainer, bf16_model):
    """pause("abort") -> delta push -> resume: `sample_through_aborts` (what episodes sample with)
    continues the aborted sequence with a new request; no token is lost and each keeps its
    version."""
    from plait.api import sample_through_aborts

    engine = TorchInferenceEngine(bf16_model, seed=0)
    sync = InProcessSync(options=InProcessSyncOptions(payload="delta", dtype="bfloat16"))

    async def body() -> None:
        await sync.push(trainer, [engine], trainer.weight_version)
        old = engine.weight_version
        request = asyncio.create_task(
            sample_through_aborts(
                engine,
                ModelInput.from_ints([1, 2, 3, 4]),
                SamplingParams(max_tokens=40, stop=[], seed=3),
            )
        )
        while not engine._batch_active:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        await engine.pause("abort")
        rl_step(trainer, 60)
        await sync.push(trainer, [engine], trainer.weight_version)
        await engine.resume()
        sequence = await request
        versions = sequence.versions()
        assert (
            len(sequence.tokens) == len(sequence.logprobs) == 40
            and sequence.stop_reason == "length"
        )
        assert versions[0] == old and versions[-1] == trainer.weight_version != old
        assert list(versions) == sorted(versions)
        await engine.close()

    run(body())
