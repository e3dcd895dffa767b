"""Fixtures for plait-remote's tests: tiny-qwen3; one `plait serve inference` service (running
plait-torch) shared by the session, whose initial weights `reset_service` puts back before each
engine attaches; and one `plait serve trainer` service, on which each engine creates a trainer
of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from plait.api import ResolvedModel
from plait_testing.models import materialize_model

pytest.importorskip("plait_torch", reason="the service runs plait-torch's engine")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    return materialize_model("tiny-qwen3", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3")


def _remote_options(**overrides):
    from plait_remote.options import RemoteOptions

    return RemoteOptions(**{"engine": "torch", "startup_timeout_s": 300.0, **overrides})


@pytest.fixture(scope="session")
def remote_options() -> Callable[..., object]:
    """(**overrides) -> RemoteOptions for plait-torch behind the service."""
    return _remote_options


@pytest.fixture(scope="session")
def service_url(tiny_model: ResolvedModel) -> Iterator[str]:
    """A service launched the way the engine launches one; the session's engines attach to it."""
    from plait_remote.engine import RemoteEngine

    launcher = RemoteEngine(tiny_model, options=_remote_options(), seed=0)
    asyncio.run(launcher._ensure_ready())
    yield launcher.base_url
    asyncio.run(launcher.close())


def reset_service(url: str, model: ResolvedModel) -> None:
    """Resume, and load the checkpoint's weights again as version 0."""
    with httpx.Client(base_url=url, timeout=120) as client:
        client.post("/resume", json={}).raise_for_status()
        client.post(
            "/load_weights", json={"path": str(model.path), "version": 0}
        ).raise_for_status()


@pytest.fixture
def make_attached(service_url: str, tiny_model: ResolvedModel) -> Callable[..., object]:
    """() -> a "remote" engine attached to the session's service, on the initial weights."""
    from plait_remote.engine import RemoteEngine

    def make(**overrides):
        reset_service(service_url, tiny_model)
        return RemoteEngine(
            tiny_model, options=_remote_options(url=service_url, **overrides), seed=0
        )

    return make


def _trainer_options(**overrides):
    from plait_remote.options import RemoteTrainerOptions

    return RemoteTrainerOptions(**{"engine": "torch", "startup_timeout_s": 300.0, **overrides})


@pytest.fixture(scope="session")
def remote_trainer_options() -> Callable[..., object]:
    """(**overrides) -> RemoteTrainerOptions for plait-torch behind the service."""
    return _trainer_options


@pytest.fixture(scope="session")
def trainer_service_url(tiny_model: ResolvedModel) -> Iterator[str]:
    """A trainer service launched the way the engine launches one; the session's engines attach to
    it."""
    from plait_remote.trainer import RemoteTrainer

    launcher = RemoteTrainer(tiny_model, options=_trainer_options(), seed=0)
    yield launcher.base_url
    launcher.close()
