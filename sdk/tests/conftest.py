"""Shared fixtures of the SDK tests."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

INTEROP = Path(__file__).parent / "interop"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "interop: runs the official ORS SDKs (ors-sdk, openreward) from their own venvs; "
        "set them up with scripts/ci/sdk.sh",
    )


def load_ors_style_env(import_line: str = "from plait_sdk import") -> types.ModuleType:
    """interop/arith_env.py (written for `ors`) with its import switched: the porting recipe."""
    path = INTEROP / "arith_env.py"
    source = path.read_text().replace("from ors import", import_line)
    module = types.ModuleType(f"arith_env_{abs(hash(import_line))}")
    sys.modules[module.__name__] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="session")
def ported_env() -> type:
    return load_ors_style_env().ArithEnv
