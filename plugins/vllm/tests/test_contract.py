"""plait-vllm against the core's inference-engine contract kit, on a real vLLM server."""

from __future__ import annotations

import pytest

from plait.api import ResolvedModel
from plait_testing.inference import InferenceEngineContract

pytestmark = pytest.mark.vllm


class TestVLLMEngine(InferenceEngineContract):
    timeout_s = 300.0
    in_flight_probes = 2  # requests reach the server on separate connections
    settle_probe_round_trips = 2.0  # and stream their tokens back on them (before an abort)
    abort_request_tokens = 2000  # the CPU build decoded all of 1000 before the pause (twice);
    # 2000 fit the server's 2048-token context

    @pytest.fixture
    def model(self, tiny_model: ResolvedModel) -> ResolvedModel:
        return tiny_model

    @pytest.fixture
    def make_engine(self, make_attached):
        return make_attached
