"""Fixtures for plait-torch's tests: the tiny Qwen3 checkpoint, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.api import ResolvedModel
from plait_testing.models import materialize_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    """tiny-qwen3 built into a temporary directory (not the user's model cache)."""
    return materialize_model("tiny-qwen3", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    """tiny-qwen3-moe (a random 2-layer Qwen3-MoE, 8 experts, 2 per token), built once per
    session."""
    return materialize_model(
        "tiny-qwen3-moe", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3-moe"
    )
