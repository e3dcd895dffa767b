"""The distributed weight sync over real gloo groups: receiver processes hosting torch engines (or
tensor-parallel shard stores) end bit-identical to the trainer; a hung receiver is named."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch

from plait.api import AdamParams, ResolvedModel, WeightSyncError
from plait_testing.trainer import rl_datum
from plait_torch.trainer import TorchTrainer
from plait_weights import patch as weight_patch
from plait_weights.distributed import DistributedSync, DistributedSyncOptions
from plait_weights.layout import TensorParallelLayout

pytestmark = pytest.mark.distributed
MAIN = Path(__file__).with_name("weight_receiver_main.py")


@pytest.fixture(scope="module")
def bf16_model(tiny_model: ResolvedModel) -> ResolvedModel:
    return attrs.evolve(tiny_model, dtype="bfloat16")


@pytest.fixture
def trainer(bf16_model: ResolvedModel) -> TorchTrainer:
    trainer = TorchTrainer(bf16_model, seed=0)
    yield trainer
    trainer.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Receivers:
    def __init__(
        self, model: ResolvedModel, port: int, world: int, tmp: Path, *, tp: bool = False
    ) -> None:
        self.reports = [tmp / f"rank{r}.json" for r in range(1, world)]
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(MAIN),
                    str(model.path),
                    model.dtype,
                    str(port),
                    str(r),
                    str(world),
                    str(r - 1 if tp else 0),
                    str(self.reports[r - 1]),
                    *(["store"] if tp else []),
                ]
            )
            for r in range(1, world)
        ]

    def finish(self) -> list[dict]:
        for proc in self.procs:
            assert proc.wait(120) == 0
        return [json.loads(p.read_text()) for p in self.reports]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(30)


def rl_step(trainer: TorchTrainer, seed: int) -> None:
    rng = np.random.default_rng(seed)
    data = [
        rl_datum(rng.integers(0, 1000, 12).tolist(), 6, [-2.0] * 6, float(rng.normal()))
        for _ in range(4)
    ]
    trainer.forward_backward(data, "importance_sampling")
    trainer.optim_step(AdamParams(learning_rate=1e-6))


def bf16_weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16) for n, t in trainer.export_weights()}


def test_delta_pushes_reach_every_receiver_bit_identical(trainer, bf16_model, tmp_path):
    port = free_port()
    receivers = Receivers(bf16_model, port, 3, tmp_path)
    sync = DistributedSync(
        options=DistributedSyncOptions(
            payload="delta", dtype="bfloat16", receivers=2, master_port=port, timeout_s=120
        )
    )

    async def body() -> list:
        stats = [await sync.push(trainer, [], trainer.weight_version)]
        for step in range(2):
            rl_step(trainer, step)
            stats.append(await sync.push(trainer, [], trainer.weight_version))
        await sync.close()
        return stats

    try:
        full, *deltas = asyncio.run(body())
        reports = receivers.finish()
    finally:
        receivers.kill()
    assert full.bytes >= full.full_bytes  # the first push is full (plus the packing's alignment)
    assert all(0 < s.bytes < 0.15 * s.full_bytes for s in deltas), deltas
    served = weight_patch.checksum(bf16_weights(trainer).items())
    for report in reports:
        assert report == {"version": trainer.weight_version, "pushes": 3, "checksum": served}


def test_tensor_parallel_receivers_get_only_their_shards(trainer, bf16_model, tmp_path):
    port = free_port()
    receivers = Receivers(bf16_model, port, 3, tmp_path, tp=True)
    sync = DistributedSync(
        options=DistributedSyncOptions(
            payload="delta",
            dtype="bfloat16",
            layout="tp",
            tp_size=2,
            head_dim=32,
            receivers=2,
            master_port=port,
        )
    )

    async def body() -> list:
        stats = [await sync.push(trainer, [], trainer.weight_version)]
        rl_step(trainer, 5)
        stats.append(await sync.push(trainer, [], trainer.weight_version))
        await sync.close()
        return stats

    try:
        full, delta = asyncio.run(body())
        reports = receivers.finish()
    finally:
        receivers.kill()
    shards = TensorParallelLayout(2, 32).ranks(bf16_weights(trainer))
    for rank, report in enumerate(reports):
        assert report["checksum"] == weight_patch.checksum(shards[rank].items())
    # each receiver got its half of the vocabulary-parallel embedding, not the whole
    assert full.bytes < 0.6 * 2 * sum(t.numel() for t in bf16_weights(trainer).values()) * 2
    assert delta.bytes < 0.15 * delta.full_bytes


def test_a_hung_receiver_is_named_within_the_timeout(trainer, bf16_model, tmp_path):
    port = free_port()
    receivers = Receivers(bf16_model, port, 3, tmp_path)
    sync = DistributedSync(
        options=DistributedSyncOptions(
            payload="delta", dtype="bfloat16", receivers=2, master_port=port, timeout_s=3
        )
    )
    hung = receivers.procs[1]

    async def body() -> float:
        await sync.push(trainer, [], trainer.weight_version)
        os.kill(hung.pid, signal.SIGSTOP)  # rank 2 stops answering, as a hung process does
        rl_step(trainer, 7)
        start = time.monotonic()
        with pytest.raises(WeightSyncError) as failure:
            await sync.push(trainer, [], trainer.weight_version)
        message = str(failure.value)
        assert f"'test-receiver-2' (rank 2, pid {hung.pid}" in message and "within 3 s" in message
        assert "test-receiver-1" not in message
        with pytest.raises(WeightSyncError, match="cannot be reused"):
            await sync.push(trainer, [], trainer.weight_version)
        return time.monotonic() - start

    try:
        detected_after = asyncio.run(body())
        print(f"hung receiver detected after {detected_after:.2f} s (timeout 3 s)")
    finally:
        receivers.kill()
