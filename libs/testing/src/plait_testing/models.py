"""Building registered models for tests: into a temporary directory, never the user's cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.api import ModelSource, ResolvedModel, UnknownComponentError, load_materializer


def materialize_model(name: str, dest: Path) -> ResolvedModel:
    """Build the registered model `name` into `dest` with its offline recipe (no hub, no cache).

    Skips the calling test when no installed plugin registers `name` (e.g. "tiny-qwen3" comes
    with plait-torch). Use it from a session-scoped fixture: tiny-qwen3 takes a few seconds.
    """
    from plait.api import get_registry

    try:
        source: ModelSource = get_registry().get("model", name).load()
    except UnknownComponentError as exc:
        pytest.skip(f"model {name!r} is not registered by any installed plugin: {exc.fix}")
    if source.materialize is None:
        pytest.skip(f"model {name!r} has no offline recipe")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    load_materializer(source.materialize)(dest)
    return ResolvedModel(name, dest, dest)


def build_resized_qwen3(base: Path, dest: Path, seed: int = 0, **config: int) -> ResolvedModel:
    """A random-init Qwen3 at `dest` with `base`'s tokenizer and config, `config` overriding its
    sizes (e.g. tiny-qwen3 widened and deepened into a ~50M-parameter model for weight-sync
    tests)."""
    import json

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    base, dest = Path(base), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != "config.json":
            (dest / item.name).write_bytes(item.read_bytes())
    fields = json.loads((base / "config.json").read_text())
    for derived in ("layer_types", "architectures", "transformers_version", "model_type"):
        fields.pop(derived, None)  # recomputed for the new sizes
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        Qwen3ForCausalLM(Qwen3Config(**{**fields, **config})).save_pretrained(
            str(dest), safe_serialization=True
        )
    finally:
        torch.random.set_rng_state(state)
    return ResolvedModel(dest.name, dest, dest)
