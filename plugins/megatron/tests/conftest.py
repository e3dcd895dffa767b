"""Small random Qwen3s built from a config (nothing downloaded)."""

from __future__ import annotations

import pytest

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def qwen3(request: pytest.FixtureRequest):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**TINY, tie_word_embeddings=request.param)
    return transformers.Qwen3ForCausalLM(config).eval()
