"""plait-vllm against the core's inference-engine contract kit, on a real vLLM server."""

from __future__ import annotations

import pytest

from plait.models import ResolvedModel
from plait.testing.inference import InferenceEngineContract

from .conftest import reset_server

pytestmark = pytest.mark.vllm


class TestVLLMEngine(InferenceEngineContract):
    timeout_s = 300.0

    @pytest.fixture
    def model(self, tiny_model: ResolvedModel) -> ResolvedModel:
        return tiny_model

    @pytest.fixture
    def make_engine(self, model: ResolvedModel, vllm_server):
        from plait_vllm.engine import VLLMEngine
        from plait_vllm.options import VLLMOptions

        def make() -> VLLMEngine:
            reset_server(vllm_server.base_url, model)
            return VLLMEngine(model, options=VLLMOptions(url=vllm_server.base_url, max_model_len=1024,
                                                                plait_worker_extension=True), seed=0)

        return make
