"""The trainer contract kit against the FSDP2 engine on 2 gloo ranks (CPU)."""

from __future__ import annotations

import pytest

from plait.api import ResolvedModel
from plait_fsdp2.options import FSDP2Options
from plait_testing.trainer import TrainerEngineContract

pytestmark = pytest.mark.distributed

TWO_RANKS = FSDP2Options(
    world_size=2, device="cpu", threads=1, micro_batch_tokens=24, call_timeout_s=300
)


class TestFSDP2Trainer(TrainerEngineContract):
    required_metrics = ("loss:sum", "entropy:mean", "model_flops:sum")

    @pytest.fixture
    def model(self, tiny_model: ResolvedModel) -> ResolvedModel:
        return tiny_model

    @pytest.fixture
    def make_trainer(self, model: ResolvedModel):
        from plait_fsdp2.engine import FSDP2Trainer

        return lambda: FSDP2Trainer(model, options=TWO_RANKS, seed=0)
