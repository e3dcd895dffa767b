"""Options of the "remote" inference engine (`inference.options` in a run config)."""

from __future__ import annotations

from typing import Any

import attrs

from plait_server.engine import ServerOptions


@attrs.frozen
class RemoteOptions(ServerOptions):
    """`url` attaches to a running `plait serve inference`; without it the engine launches one
    (with `python`, default this interpreter) that runs `engine` with `engine_options`, and
    launches it again with its weights if it dies."""

    engine: str = "torch"
    """The inference engine the launched service runs (any installed one but "remote")."""
    engine_options: dict[str, Any] = attrs.field(factory=dict)
    """That engine's options (its `inference.options`)."""
