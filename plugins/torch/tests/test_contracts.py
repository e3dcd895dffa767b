"""plait-torch's engines against the core's contract kits, on the tiny Qwen3 model."""

from __future__ import annotations

import pytest

from plait.api import LoraConfig, ResolvedModel, TrainerEngine
from plait_testing.inference import InferenceEngineContract
from plait_testing.trainer import TrainerEngineContract
from plait_torch.options import LoraOptions, TorchInferenceOptions, TorchTrainerOptions


class TestTorchTrainer(TrainerEngineContract):
    """Full fine-tuning, LoRA (only adapters train: every promise must hold the same), and one
    adapter of many on a shared base (`open_adapter`: an engine of its own)."""

    required_metrics = ("loss:sum", "entropy:mean", "model_flops:sum")

    @pytest.fixture
    def model(self, tiny_model: ResolvedModel) -> ResolvedModel:
        return tiny_model

    @pytest.fixture(params=["full", "lora", "adapter"])
    def make_trainer(self, model: ResolvedModel, request: pytest.FixtureRequest):
        from plait_torch.trainer import TorchTrainer

        # A small micro-batch so that the kit's batches are split into several forward passes.
        lora = LoraOptions(rank=4, alpha=8.0) if request.param == "lora" else None
        options = TorchTrainerOptions(micro_batch_tokens=24, lora=lora)
        if request.param == "adapter":  # beside another adapter, which must not disturb it

            def opened() -> TrainerEngine:
                host = TorchTrainer(model, options=options, seed=0)
                host.open_adapter("neighbour", LoraConfig(rank=2, alpha=2.0), seed=1)
                return host.open_adapter("run", LoraConfig(rank=4, alpha=8.0), seed=0)

            return opened
        return lambda: TorchTrainer(model, options=options, seed=0)


class TestTorchInference(InferenceEngineContract):
    @pytest.fixture
    def model(self, tiny_model: ResolvedModel) -> ResolvedModel:
        return tiny_model

    @pytest.fixture
    def make_engine(self, model: ResolvedModel):
        from plait_torch.inference import TorchInferenceEngine

        return lambda: TorchInferenceEngine(model, options=TorchInferenceOptions(), seed=0)
