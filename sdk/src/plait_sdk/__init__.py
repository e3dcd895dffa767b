"""plait-sdk: write RL environments, run them in-process, serve them over ORS.

    from plait_sdk import Environment, tool, ToolOutput, TextBlock, Split
"""

from plait.types import ImageBlock, Message, Split, TextBlock, ToolError, ToolOutput, ToolSpec
from plait_sdk.environment import Environment, Toolset, terminal, tool
from plait_sdk.local import LocalEnvironment, LocalSession

__all__ = [
    "Environment",
    "ImageBlock",
    "LocalEnvironment",
    "LocalSession",
    "Message",
    "Split",
    "TextBlock",
    "ToolError",
    "ToolOutput",
    "ToolSpec",
    "Toolset",
    "terminal",
    "tool",
]
