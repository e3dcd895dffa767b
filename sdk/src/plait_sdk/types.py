"""The ORS wire types that environment authors touch, beside the core ones in `plait.types`.

`TextBlock`, `ImageBlock`, `ToolOutput`, `ToolSpec` and `Split` are the core attrs classes (they
take the same keyword arguments as the `ors` package's pydantic models). This module adds the rest
of the `ors` / `openreward` type surface so that an environment written against those packages
ports by changing its import, and the conversions between these types and their JSON form on the
wire.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs

from plait.api import (
    Block,
    ImageBlock,
    Message,
    Split,
    TextBlock,
    ToolError,
    ToolErrorReason,
    ToolOutput,
    ToolSpec,
    blocks_text,
)

JSONValue = Any
JSONObject = Mapping[str, Any]
Blocks = Sequence[Block]

SPLIT_TYPES: tuple[Literal["train", "validation", "test"], ...] = ("train", "validation", "test")
# Block types this SDK accepts in messages (advertised as ListToolsOutput.message_block_types).
MESSAGE_BLOCK_TYPES = ("text", "image")
# plait's extension of /create: the routes whose answers it adds for a new session
# (plait_sdk.server).
INCLUDE_HEADER = "X-Plait-Include"
INCLUDABLE = ("messages", "task_tools")


@attrs.frozen
class TerminalToolSpec:
    """The tool a plain (tool-call-free) assistant message is passed to; `arg` is its one field."""

    name: str
    arg: str | None = None
    description: str = ""


def _tool_list(tools: Iterable[ToolSpec]) -> list[ToolSpec]:
    return list(tools)


@attrs.frozen
class ListToolsOutput:
    """A tool listing as ORS servers send it.

    It also iterates, indexes and measures like its `tools` list, so code written for either the
    `ors` shape (`env.list_tools().tools`) or a plain list (`for spec in env.list_tools()`) works.
    """

    tools: list[ToolSpec] = attrs.field(factory=list, converter=_tool_list)
    terminal_tool: TerminalToolSpec | None = None
    supports_score_group: bool | None = None
    message_block_types: list[str] | None = None

    def __iter__(self) -> Iterator[ToolSpec]:
        return iter(self.tools)

    def __len__(self) -> int:
        return len(self.tools)

    def __getitem__(self, index: int) -> ToolSpec:
        return self.tools[index]


@attrs.frozen
class RunToolSuccess:
    output: ToolOutput
    ok: Literal[True] = True


@attrs.frozen
class RunToolError:
    error: str
    reason: ToolErrorReason | None = None
    ok: Literal[False] = False


RunToolOutput = RunToolSuccess | RunToolError


# ---------------------------------------------------------------------------------------------
# Conversions to and from the wire's JSON
# ---------------------------------------------------------------------------------------------


def block_to_wire(block: Block) -> dict[str, Any]:
    if isinstance(block, ImageBlock):
        return {
            "type": "image",
            "data": block.data,
            "mimeType": block.mimeType,
            "detail": block.detail,
        }
    return {"type": "text", "text": block.text, "detail": block.detail}


def block_from_wire(data: Any) -> Block:
    """A block from its JSON; raises ValueError naming what is wrong."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a block must be a JSON object, got {type(data).__name__}")
    kind = data.get("type", "text")
    detail = data.get("detail")
    if detail is not None and not isinstance(detail, Mapping):
        raise ValueError(f"block detail must be an object or null, got {type(detail).__name__}")
    if kind == "text":
        if not isinstance(data.get("text"), str):
            raise ValueError("a text block needs a string 'text'")
        return TextBlock(text=data["text"], detail=dict(detail) if detail else None)
    if kind == "image":
        if not isinstance(data.get("data"), str) or not isinstance(data.get("mimeType"), str):
            raise ValueError("an image block needs string 'data' (base64) and 'mimeType'")
        return ImageBlock(
            data=data["data"], mimeType=data["mimeType"], detail=dict(detail) if detail else None
        )
    raise ValueError(f"unknown block type {kind!r}; expected 'text' or 'image'")


def as_block(value: Any) -> Block:
    """A core block from a core block, an `ors`/`openreward` block object, or a block's JSON."""
    if isinstance(value, TextBlock | ImageBlock):
        return value
    if isinstance(value, Mapping):
        return block_from_wire(value)
    if hasattr(value, "type"):  # a pydantic block from the ors / openreward packages
        return block_from_wire(
            {k: getattr(value, k, None) for k in ("type", "text", "data", "mimeType", "detail")}
        )
    raise TypeError(f"expected a TextBlock or ImageBlock, got {type(value).__name__}")


def tool_output_to_wire(output: ToolOutput) -> dict[str, Any]:
    # Every key is always present: both official clients read metadata/reward/finished directly.
    return {
        "blocks": [block_to_wire(b) for b in output.blocks],
        "metadata": output.metadata,
        "reward": output.reward,
        "finished": output.finished,
    }


def tool_output_from_wire(data: Mapping[str, Any]) -> ToolOutput:
    blocks = data.get("blocks") or []
    if not isinstance(blocks, list):
        raise ValueError("tool output 'blocks' must be a list")
    reward = data.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, int | float)):
        raise ValueError(f"tool output 'reward' must be a number or null, got {reward!r}")
    metadata = data.get("metadata")
    return ToolOutput(
        blocks=[block_from_wire(b) for b in blocks],
        reward=None if reward is None else float(reward),
        finished=bool(data.get("finished", False)),
        metadata=dict(metadata) if isinstance(metadata, Mapping) else None,
    )


def run_tool_result_to_wire(result: ToolOutput | ToolError) -> dict[str, Any]:
    if isinstance(result, ToolError):
        return {"ok": False, "error": result.error, "reason": result.reason}
    return {"ok": True, "output": tool_output_to_wire(result)}


_WIRE_REASONS = ("not_found", "name_collision", "input_validation", "episode_finished", "exception")


def run_tool_result_from_wire(data: Any) -> ToolOutput | ToolError:
    if not isinstance(data, Mapping) or "ok" not in data:
        raise ValueError(f"a tool result must be an object with 'ok', got {str(data)[:200]}")
    if data["ok"]:
        return tool_output_from_wire(data.get("output") or {})
    error = str(data.get("error", "the tool call failed"))
    reason = data.get("reason")
    return ToolError(error, reason if reason in _WIRE_REASONS else _infer_reason(error))


def _infer_reason(error: str) -> ToolErrorReason:
    """The failure kind from the message, for servers older than the `reason` field."""
    if error.startswith("Tool name collision"):
        return "name_collision"
    if error.startswith("Tool input validation error"):
        return "input_validation"
    if "is not a valid tool" in error:
        return "not_found"
    if "episode has finished" in error:
        return "episode_finished"
    return "exception"


def tool_spec_to_wire(spec: ToolSpec) -> dict[str, Any]:
    # Exactly these three keys: extra keys (e.g. "title") break the official clients.
    return {"name": spec.name, "description": spec.description, "input_schema": spec.input_schema}


def tool_spec_from_wire(data: Any) -> ToolSpec:
    if not isinstance(data, Mapping) or not isinstance(data.get("name"), str):
        raise ValueError(
            f"a tool spec must be an object with a string 'name', got {str(data)[:200]}"
        )
    schema = data.get("input_schema")
    return ToolSpec(
        name=data["name"],
        description=str(data.get("description") or ""),
        input_schema=dict(schema) if isinstance(schema, Mapping) else None,
    )


def terminal_tool_from_spec(spec: ToolSpec) -> TerminalToolSpec:
    properties = list((spec.input_schema or {}).get("properties", {}))
    return TerminalToolSpec(
        name=spec.name, arg=properties[0] if properties else None, description=spec.description
    )


def terminal_tool_to_spec(terminal: TerminalToolSpec) -> ToolSpec:
    """A terminal tool as a core ToolSpec: one string argument (or none)."""
    schema: dict[str, Any] = {"type": "object", "properties": {}}
    if terminal.arg is not None:
        schema = {
            "type": "object",
            "properties": {terminal.arg: {"type": "string"}},
            "required": [terminal.arg],
        }
    return ToolSpec(name=terminal.name, description=terminal.description, input_schema=schema)


def list_tools_to_wire(
    tools: Sequence[ToolSpec], terminal: ToolSpec | None, supports_score_group: bool = False
) -> dict[str, Any]:
    term = terminal_tool_from_spec(terminal) if terminal is not None else None
    return {
        "tools": [tool_spec_to_wire(t) for t in tools],
        "terminal_tool": attrs.asdict(term) if term is not None else None,
        "supports_score_group": supports_score_group,
        "message_block_types": list(MESSAGE_BLOCK_TYPES),
    }


def split_to_wire(split: Split) -> dict[str, str]:
    return {"name": split.name, "type": split.type}


def split_from_wire(data: Any) -> Split:
    if isinstance(data, str):  # a bare name, as some servers list them
        return Split(data, data if data in SPLIT_TYPES else "validation")
    if not isinstance(data, Mapping) or not isinstance(data.get("name"), str):
        raise ValueError(f"a split must be an object with a string 'name', got {str(data)[:200]}")
    kind = data.get("type")
    return Split(data["name"], kind if kind in SPLIT_TYPES else "validation")


def message_to_wire(message: Message) -> dict[str, Any]:
    """A core chat message in the ORS (openreward) message shape: role plus blocks."""
    role = message.role if message.role in ("system", "user", "assistant") else "user"
    return {
        "role": role,
        "blocks": [{"type": "text", "text": message.content, "detail": None}],
        "detail": None,
    }


def message_from_wire(data: Any) -> Message:
    if not isinstance(data, Mapping) or data.get("role") not in ("system", "user", "assistant"):
        raise ValueError(
            f"a message must be an object with role system/user/assistant, got {str(data)[:200]}"
        )
    texts = [
        b.get("text", "")
        for b in data.get("blocks") or []
        if isinstance(b, Mapping) and b.get("type") == "text"
    ]
    return Message(data["role"], "\n".join(texts))


def prompt_as_messages(blocks: Sequence[Block]) -> list[Message]:
    return [Message("user", blocks_text(blocks))]


def dumps(data: Any) -> str:
    """Compact ASCII JSON: no raw whitespace outside strings, so SSE chunks can be cut safely."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def is_finite_reward(value: float | None) -> bool:
    return value is None or math.isfinite(value)
