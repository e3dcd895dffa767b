"""Pieces of a trainer's saved state: RNG states, and checkpoint directories that appear
atomically."""

from __future__ import annotations

import os
import random
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plait.api import ModelError, fsync_dir


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_dir_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` fills a fresh temporary directory next to `path`, which is then fsynced and
    renamed into place (`replace_dir`); on any error the temporary directory is removed and
    `path` stays as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_sibling(path)
    try:
        tmp.mkdir()
        write(tmp)
        fsync_tree(tmp)
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_same_parameters(
    saved: Mapping[str, list[int]], expected: Mapping[str, list[int]], path: Path
) -> None:
    """Fail, naming a few, when a saved state's parameter names or shapes are not this model's."""
    differing = sorted(n for n in saved.keys() | expected.keys() if saved.get(n) != expected.get(n))
    if differing:
        raise ModelError(
            f"trainer state {path} was saved from a different model (or other LoRA settings): "
            f"{len(differing)} parameters differ in name or shape, e.g. {differing[:3]}",
            fix="load it into a trainer built on the same model, "
            "with the same trainer.options.lora",
        )


def temporary_sibling(path: Path) -> Path:
    """A fresh name next to `path` to write into before `replace_dir(tmp, path)`."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_tree(root: Path) -> None:
    for file in root.rglob("*"):
        if file.is_file():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(root)


def replace_dir(tmp: Path, dest: Path) -> None:
    """Move the complete `tmp` to `dest`. An existing `dest` is moved aside first and removed
    afterwards: a crash in between leaves the complete old state as `.NAME.old-*`, never a torn
    one."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        dest.rename(old)
    tmp.rename(dest)
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
