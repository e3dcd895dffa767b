"""Fixtures for plait-fsdp2's tests: tiny-qwen3-8k (registered by plait-torch; tiny-qwen3 with a
19x smaller output head, which the trainer's checks do not need whole) built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.api import ResolvedModel
from plait_testing.models import materialize_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    return materialize_model(
        "tiny-qwen3-8k", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3-8k"
    )


@pytest.fixture(scope="session")
def full_vocabulary_model(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    """tiny-qwen3 itself, for the element-wise parity with one process: on tiny-qwen3-8k's larger
    per-row gradients, float32 sums in another order differ by up to 1.3e-6 in an embedding
    weight after one step (measured), over the 1e-6 that comparison holds."""
    return materialize_model("tiny-qwen3", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3")
