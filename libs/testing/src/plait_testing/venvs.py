"""Interpreters of the engines whose packages live in a virtualenv of their own (vLLM and SGLang
pin their own torch and transformers); scripts/ci/*.sh build them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def venv_python(variable: str, default: Path, setup: str) -> str:
    """The python of the venv that `$variable` names (else `default`), or a skip of the calling
    test that says how to build it."""
    root = Path(os.environ.get(variable) or default)
    python = root / "bin" / "python"
    if not python.is_file():
        pytest.skip(f"no venv at {root}: run {setup} (or set {variable})")
    return str(python)
