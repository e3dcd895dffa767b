"""Fixtures for plait-vllm's tests: the tiny Qwen3 checkpoint and one real vLLM server per session.

The `vllm`-marked tests run a real vLLM (CPU build) from the venv that scripts/ci/vllm.sh builds:
$PLAIT_VLLM_VENV, by default .venvs/vllm in the repository. Starting the server takes a minute or
more on two cores, so the tests share one (each test's engine attaches to it by URL, after
`reset_server` put the initial weights and version 0 back); tests of launching start their own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from plait.api import ResolvedModel
from plait_testing.models import materialize_model
from plait_testing.venvs import venv_python

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return venv_python("PLAIT_VLLM_VENV", REPO / ".venvs" / "vllm", "scripts/ci/vllm.sh")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    return materialize_model("tiny-qwen3", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3")


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: str, tiny_model: ResolvedModel, tmp_path_factory: pytest.TempPathFactory
):
    """A launched vLLM server on tiny-qwen3 (float32, so logprobs match the float32 trainer), with
    the gloo weight-transfer backend."""
    from plait_vllm.engine import VLLMEngine
    from plait_vllm.options import VLLMOptions

    log_path = Path(tmp_path_factory.mktemp("vllm")) / "server.log"
    options = VLLMOptions(
        python=vllm_python,
        dtype="float32",
        max_model_len=2048,  # room for the contract kit's long requests
        log_path=str(log_path),
        weight_transfer_backend="gloo",
    )
    engine = VLLMEngine(tiny_model, options=options, seed=0)
    try:
        asyncio.run(engine._ensure_ready())
        yield engine
    finally:
        asyncio.run(engine.close())


def reset_server(url: str, model: ResolvedModel) -> None:
    """Resume the server and put the model's initial weights back as version 0."""
    with httpx.Client(base_url=url, timeout=120) as client:
        client.post("/resume").raise_for_status()
        reply = client.post(
            "/collective_rpc",
            json={"method": "plait_reload_weights", "kwargs": {"weights_path": str(model.path)}},
        )
        reply.raise_for_status()
        client.post("/update_weight_version", json={"new_version": "0"}).raise_for_status()
        client.post("/reset_prefix_cache").raise_for_status()


@pytest.fixture
def make_attached(vllm_server, tiny_model: ResolvedModel):
    """(**options) -> an engine attached to the session's server, on the initial weights."""
    from plait_vllm.engine import VLLMEngine
    from plait_vllm.options import VLLMOptions

    def make(**options):
        reset_server(vllm_server.base_url, tiny_model)
        options = {"max_model_len": 2048, "plait_worker_extension": True, **options}
        return VLLMEngine(
            tiny_model, options=VLLMOptions(url=vllm_server.base_url, **options), seed=0
        )

    return make
