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
    # the CPU build decoded all of 1000 before an abort (twice) and the OpenAI engine on it all of
    # 256 before a keep pause (in a bare CI run); the server's context is 2048 for these
    abort_request_tokens = 2000
    keep_request_tokens = 1000

    @pytest.fixture
    def model(self, tiny_model: ResolvedModel) -> ResolvedModel:
        return tiny_model

    @pytest.fixture
    def make_engine(self, make_attached):
        return make_attached
