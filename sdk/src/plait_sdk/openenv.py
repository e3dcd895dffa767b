"""OpenEnv (openenv-core) both ways: what the driver (`openenv_client`, env.name = "openenv") and
the server (`openenv_server`, `plait env serve --protocol openenv`) share.

Both speak OpenEnv's wire themselves (read from openenv-core 0.3.0's `EnvClient` and
`HTTPEnvServer`), so neither imports openenv-core, which pins gradio and fastmcp: an episode is
one WebSocket on `/ws` carrying JSON text frames,

    -> {"type": "reset", "data": {"seed": 3, ...}}   <- {"type": "observation", "data": RESULT}
    -> {"type": "step", "data": ACTION}              <- {"type": "observation", "data": RESULT}
    -> {"type": "state"}                             <- {"type": "state", "data": {...}}
    -> {"type": "close"}                             (the server ends the session)

where RESULT is `{"observation": {...fields...}, "reward": float | null, "done": bool}` and any
request may be answered `{"type": "error", "data": {"message": ..., "code": ...}}`. Plain HTTP
`POST /reset` and `/step` build a fresh environment each, so episodes need the WebSocket.
"""

from __future__ import annotations

from typing import Any

from plait.api import PlaitError

OPENENV_CORE_VERSION = "0.3.0"
"""The openenv-core release both directions are tested against."""
INSTALL_HINT = "pip install 'plait-sdk[openenv]'"


class MissingPackage(PlaitError, ValueError):
    """A package this needs is not installed (a ValueError too, so option checks report it
    under the options' key)."""


def require_websockets(who: str) -> Any:
    """The `websockets` package, or MissingPackage naming `who` and the install command."""
    try:
        import websockets
    except ImportError:
        raise MissingPackage(
            f"{who} needs the websockets package (OpenEnv's wire is a WebSocket), which is not "
            "installed",
            fix=INSTALL_HINT,
        ) from None
    return websockets
