"""plait-sglang's bounded failures (the core's server-engine failure contract), and its wire
helpers; no server needed."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

from plait.api import DataError, EngineError, ResolvedModel
from plait_server.testing import ServerEngineFailureContract
from plait_sglang.engine import decode_routed_experts, stop_params
from plait_sglang.options import SGLangOptions


@pytest.fixture
def model(tmp_path: Path) -> ResolvedModel:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "num_hidden_layers": 2}))
    return ResolvedModel("config-only", tmp_path, tmp_path)


class TestSGLangFailures(ServerEngineFailureContract):
    ready_routes = {"GET /model_info": {"weight_version": "default"}}

    @pytest.fixture
    def make_engine(self, model: ResolvedModel):
        from plait_sglang.engine import SGLangEngine

        return lambda **options: SGLangEngine(model, options=SGLangOptions(**options), seed=0)


def test_stop_translation() -> None:
    assert stop_params(None) == {}
    assert stop_params([]) == {"ignore_eos": True}
    assert stop_params(["\n"]) == {"stop": ["\n"], "ignore_eos": True}
    # SGLang's ignore_eos also disables stop_token_ids, so token stops go without it
    assert stop_params([5, 6]) == {"stop_token_ids": [5, 6]}
    with pytest.raises(DataError, match="empty"):
        stop_params([""])


def test_routed_experts_are_raw_int32() -> None:
    routing = np.arange(5 * 2 * 3, dtype=np.int32).reshape(5, 2, 3)
    encoded = base64.b64encode(routing.astype("<i4").tobytes()).decode()
    np.testing.assert_array_equal(decode_routed_experts(encoded, 2, 3).to_numpy(), routing)
    with pytest.raises(EngineError, match="multiple"):
        decode_routed_experts(encoded, 4, 4)
