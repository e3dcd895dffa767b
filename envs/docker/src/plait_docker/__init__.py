"""plait-docker: untrusted programs run and graded inside Docker containers.

    from plait_docker import Sandbox, SandboxOptions

The names load on first use, so that plugin discovery (which imports `plait_docker.plugin`)
does not import the Docker SDK.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Sandbox": "plait_docker.sandbox",
    "SandboxOptions": "plait_docker.sandbox",
    "ExecutionResult": "plait_docker.sandbox",
    "SandboxFault": "plait_docker.sandbox",
    "janitor": "plait_docker.sandbox",
    "build_image": "plait_docker.image",
    "ImageRecipe": "plait_docker.image",
    "CodeTask": "plait_docker.grading",
    "grade_answer": "plait_docker.grading",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'plait_docker' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
