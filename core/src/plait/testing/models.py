"""Building registered models for tests: into a temporary directory, never the user's cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.errors import UnknownComponentError
from plait.models import ModelSource, ResolvedModel, _load_callable


def materialize_model(name: str, dest: Path) -> ResolvedModel:
    """Build the registered model `name` into `dest` with its offline recipe (no hub, no cache).

    Skips the calling test when no installed plugin registers `name` (e.g. "tiny-qwen3" comes
    with plait-torch). Use it from a session-scoped fixture: tiny-qwen3 takes a few seconds.
    """
    from plait.plugins import get_registry

    try:
        source: ModelSource = get_registry().get("model", name).load()
    except UnknownComponentError as exc:
        pytest.skip(f"model {name!r} is not registered by any installed plugin: {exc.fix}")
    if source.materialize is None:
        pytest.skip(f"model {name!r} has no offline recipe")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _load_callable(source.materialize)(dest)
    return ResolvedModel(name, dest, dest)
