"""plait-sdk: write RL environments, run them in-process, serve them over ORS.

    from plait_sdk import Environment, tool, ToolOutput, TextBlock, Split

The names of the `ors` package (and the environment names of `openreward.environments`) are all
here, so an environment written for either ports by changing its import.
"""

from plait.api import ImageBlock, Message, Split, TextBlock, ToolError, ToolOutput, ToolSpec
from plait_sdk.environment import Environment, Toolset, terminal, tool
from plait_sdk.local import LocalEnvironment, LocalSession
from plait_sdk.types import (
    Blocks,
    JSONObject,
    JSONValue,
    ListToolsOutput,
    RunToolError,
    RunToolOutput,
    RunToolSuccess,
    TerminalToolSpec,
)


def __getattr__(name: str) -> object:
    # The server pulls in uvicorn and pydantic models; import it only when asked for, so that
    # plugin discovery (which imports plait_sdk.plugin) stays light.
    if name in ("Server", "ServerOptions"):
        from plait_sdk import server

        return getattr(server, name)
    raise AttributeError(f"module 'plait_sdk' has no attribute {name!r}")


__all__ = [
    "Blocks",
    "Environment",
    "ImageBlock",
    "JSONObject",
    "JSONValue",
    "ListToolsOutput",
    "LocalEnvironment",
    "LocalSession",
    "Message",
    "RunToolError",
    "RunToolOutput",
    "RunToolSuccess",
    "Server",
    "ServerOptions",
    "Split",
    "TerminalToolSpec",
    "TextBlock",
    "ToolError",
    "ToolOutput",
    "ToolSpec",
    "Toolset",
    "terminal",
    "tool",
]
