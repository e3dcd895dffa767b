"""Fixtures for plait-fsdp2's tests: tiny-qwen3 (registered by plait-torch) built once per
session."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.api import ResolvedModel
from plait_testing.models import materialize_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    return materialize_model("tiny-qwen3", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3")
