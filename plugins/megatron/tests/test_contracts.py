"""The trainer contract kit against the Megatron engine on tiny-qwen3, on the CPU (megatron-core's
layers with plait's SDPA core attention)."""

from __future__ import annotations

import pytest

from plait.api import ResolvedModel
from plait_testing.trainer import TrainerEngineContract

pytest.importorskip("megatron.core")


class TestMegatronTrainer(TrainerEngineContract):
    @pytest.fixture
    def make_trainer(self, model: ResolvedModel):
        from plait_megatron.engine import MegatronTrainer
        from plait_megatron.options import MegatronOptions

        # A small micro-batch so that the kit's batches are split into several forward passes.
        options = MegatronOptions(device="cpu", micro_batch_tokens=24)
        return lambda: MegatronTrainer(model, options=options, seed=0)

    @pytest.fixture
    def model(self, tiny_model: ResolvedModel) -> ResolvedModel:
        return tiny_model

    required_metrics = ("loss:sum", "entropy:mean", "model_flops:sum")
