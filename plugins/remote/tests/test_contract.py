"""The "remote" engine (plait-torch behind `plait serve inference`) against the inference-engine
contract kit: every promise the in-process engine keeps, it keeps across the wire."""

from __future__ import annotations

import pytest

from plait.api import ResolvedModel
from plait_testing.inference import InferenceEngineContract


class TestRemoteEngine(InferenceEngineContract):
    timeout_s = 300.0
    # plait-torch behind the service runs a batch to its end before it takes the next, so a
    # second probe would wait for the long request; the first shares its batch (the engine lets
    # its queue settle before taking one, which absorbs the requests' different connections)
    in_flight_probes = 1
    settle_probe_round_trips = 2.0  # the abort test: tokens made, not just a batch started

    @pytest.fixture
    def model(self, tiny_model: ResolvedModel) -> ResolvedModel:
        return tiny_model

    @pytest.fixture
    def make_engine(self, make_attached):
        return make_attached
