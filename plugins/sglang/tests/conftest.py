"""Fixtures for plait-sglang's tests: the tiny Qwen3 checkpoint and a fake SGLang server.

SGLang has no CPU build here, so the engine runs against `plait_sglang.fake_server` (SGLang's
wire protocol on a transformers model), launched exactly as the engine launches a real server
(`launch_module`). The contract tests share one fake server per session; `reset_server` puts the
initial weights and version back before each engine attaches.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import httpx
import pytest

from plait.api import ResolvedModel
from plait_testing.models import materialize_model
from plait_testing.venvs import venv_python

REPO = Path(__file__).resolve().parents[3]
FAKE = "plait_sglang.fake_server"


def sglang_venv() -> Path:
    return Path(os.environ.get("PLAIT_SGLANG_VENV") or REPO / ".venvs" / "sglang")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    return materialize_model("tiny-qwen3", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3")


def _fake_options(**overrides):
    from plait_sglang.options import SGLangOptions

    return SGLangOptions(
        **{
            "python": sys.executable,
            "launch_module": FAKE,
            "context_length": 1024,
            "startup_timeout_s": 120.0,
            **overrides,
        }
    )


@pytest.fixture(scope="session")
def fake_options():
    """(**options) -> SGLangOptions that launch the fake server from this interpreter."""
    return _fake_options


@pytest.fixture(scope="session")
def sglang_python() -> str:
    return venv_python("PLAIT_SGLANG_VENV", sglang_venv(), "scripts/ci/sglang.sh")


@pytest.fixture(scope="session")
def wire_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every request and reply of the session's fake server (checked against SGLang's api_types)."""
    return Path(tmp_path_factory.mktemp("wire")) / "wire.jsonl"


@pytest.fixture(scope="session")
def fake_server(
    tiny_model: ResolvedModel, wire_log: Path, tmp_path_factory: pytest.TempPathFactory
):
    """A launched fake SGLang server (0.5.23 wire) on tiny-qwen3, recording its wire traffic."""
    from plait_sglang.engine import SGLangEngine

    log_path = Path(tmp_path_factory.mktemp("sglang")) / "server.log"
    engine = SGLangEngine(
        tiny_model,
        options=_fake_options(
            log_path=str(log_path), enable_lora=True, server_args=["--record", str(wire_log)]
        ),
        seed=0,
    )
    try:
        asyncio.run(engine._ensure_ready())
        yield engine
    finally:
        asyncio.run(engine.close())


def reset_server(url: str, model: ResolvedModel) -> None:
    """Resume generation and put the model's initial weights back as the initial version."""
    with httpx.Client(base_url=url, timeout=120) as client:
        client.post("/continue_generation", json={}).raise_for_status()
        client.post(
            "/update_weights_from_disk",
            json={"model_path": str(model.path), "weight_version": "default"},
        ).raise_for_status()


@pytest.fixture
def make_attached(fake_server, tiny_model: ResolvedModel):
    """() -> an engine attached to the session's fake server, on the initial weights."""
    from plait_sglang.engine import SGLangEngine

    def make(**overrides):
        reset_server(fake_server.base_url, tiny_model)
        return SGLangEngine(
            tiny_model, options=_fake_options(url=fake_server.base_url, **overrides), seed=0
        )

    return make
