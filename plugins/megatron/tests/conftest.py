"""Fixtures for plait-megatron's tests: small random Qwen3s built from a config, and tiny-qwen3-8k
(registered by plait-torch) built once per session. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.api import ResolvedModel
from plait_testing.models import materialize_model

TINY = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
}


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def qwen3(request: pytest.FixtureRequest):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**TINY, tie_word_embeddings=request.param)
    return transformers.Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    """tiny-qwen3-8k (tiny-qwen3 with a 19x smaller output head, which the trainer's checks do
    not need whole) built into a temporary directory (not the user's model cache)."""
    return materialize_model(
        "tiny-qwen3-8k", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3-8k"
    )
