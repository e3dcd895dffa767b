"""No engine, no execution: without a reachable Docker engine nothing is created and nothing
runs."""

from __future__ import annotations

import pytest

from plait.api import EngineError, build
from plait_docker.engine import connect
from plait_docker.sandbox import Sandbox


@pytest.fixture
def no_engine(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/docker.sock")  # nothing listens there


def test_connect_names_the_address_and_how_to_start_an_engine(no_engine, tmp_path):
    with pytest.raises(EngineError) as err:
        connect()
    assert str(tmp_path / "docker.sock") in err.value.message
    assert "dockerd" in err.value.fix and "docker.io" in err.value.fix


@pytest.mark.parametrize("name", ["code.humaneval", "code.python", "code.humaneval_multiturn"])
def test_creating_a_code_env_without_an_engine_fails(no_engine, name):
    with pytest.raises(EngineError, match="no Docker engine is reachable") as err:
        build("env", name)
    assert "dockerd" in err.value.fix


def test_a_sandbox_cannot_be_created_without_an_engine(no_engine):
    with pytest.raises(EngineError):
        Sandbox()
