"""Text formats that chat templates share: tool schemas, reasoning blocks and tool calls.

Two tool-call formats cover the Qwen families (and every template derived from them):

- "json" (Hermes / Qwen2.5 / Qwen3):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`
- "xml" (Qwen3.5 / Qwen3-Coder):
  `<tool_call>\\n<function=f>\\n<parameter=p>\\nv\\n</parameter>\\n</function>\\n</tool_call>`

Renderers write calls in these formats and parse sampled text back with `parse_tool_calls`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import attrs

from plait.api import Message, ToolCall, ToolSpec

ToolCallFormat = Literal["json", "xml"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def openai_tool(spec: ToolSpec) -> dict[str, Any]:
    """A tool in the OpenAI function format that Hugging Face chat templates expect."""
    return {
        "type": "function",
        "function": {
            "name": spec.name,
            "description": spec.description,
            "parameters": spec.input_schema or {"type": "object", "properties": {}},
        },
    }


def to_json(value: Any) -> str:
    """JSON exactly as the `tojson` filter of Hugging Face chat templates writes it."""
    return json.dumps(value, ensure_ascii=False)


def split_reasoning(text: str, *, prompt_opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a sampled assistant text.

    `prompt_opened` says the generation prompt already ended in `<think>`, so the text starts
    inside the block. Without a closing `</think>` the text is all reasoning when the block was
    open (a response cut off while thinking) and all content otherwise. Newlines that frame the
    block are framing, not content (the Qwen templates strip them the same way).

    The reasoning runs from the block's opening `<think>` (the prompt's, or the first one in the
    text) to the first `</think>`, as vLLM's and SGLang's reasoning parsers read it: a `<think>`
    the model writes inside its reasoning is reasoning text, and re-rendering the message writes
    the sampled text again.
    """
    before, closed, after = text.partition(THINK_CLOSE)
    if closed:
        if not prompt_opened and THINK_OPEN in before:
            before = before.partition(THINK_OPEN)[2]
        return before.strip("\n"), after.lstrip("\n")
    if prompt_opened:
        return text.strip("\n"), ""
    if text.startswith(THINK_OPEN):
        return text[len(THINK_OPEN) :].strip("\n"), ""
    return None, text


# ---------------------------------------------------------------------------------------------
# Writing tool calls
# ---------------------------------------------------------------------------------------------


def tool_call_arguments(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as an object. OpenAI-style clients give them as a JSON string, which
    vLLM and SGLang parse before the chat template writes the object; so does this. A string that
    does not hold a JSON object is refused (a template would write it verbatim as the "object")."""
    arguments: Any = call.arguments
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        shown = arguments if len(arguments) <= 80 else arguments[:77] + "..."
        raise ValueError(
            f"tool call {call.name!r}: its arguments must be a JSON object, or a string "
            f"that holds one; got the string {shown!r}"
        )
    return parsed


def json_tool_call(call: ToolCall) -> str:
    """One call in the Qwen3 / Hermes format, as the Qwen3 chat template writes it."""
    arguments = to_json(tool_call_arguments(call))
    return (
        f'{TOOL_CALL_OPEN}\n{{"name": "{call.name}", "arguments": {arguments}}}\n{TOOL_CALL_CLOSE}'
    )


def xml_parameter_value(value: Any) -> str:
    """A parameter value as the Qwen3.5 template writes it: JSON for containers, str() otherwise."""
    if isinstance(value, dict | list | tuple):
        return to_json(value)
    return str(value)


def xml_tool_call(call: ToolCall) -> str:
    """One call in the Qwen3.5 / Qwen3-Coder XML format."""
    params = "".join(
        f"<parameter={key}>\n{xml_parameter_value(value)}\n</parameter>\n"
        for key, value in tool_call_arguments(call).items()
    )
    return f"{TOOL_CALL_OPEN}\n<function={call.name}>\n{params}</function>\n{TOOL_CALL_CLOSE}"


# ---------------------------------------------------------------------------------------------
# Parsing tool calls
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class ParsedToolCalls:
    """What `parse_tool_calls` found in an assistant text."""

    content: str
    """The text before the first tool call, with the separator the template writes removed."""
    calls: tuple[ToolCall, ...] = ()
    error: str | None = None
    """Why a tool call could not be read (then the response is malformed)."""


_XML_FUNCTION = re.compile(r"\A\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _json_call(body: str) -> ToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"the tool call is not valid JSON ({exc.msg} at column {exc.colno})"
        ) from None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise ValueError('a tool call must be a JSON object with a string "name"')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError('the "arguments" string of a tool call is not valid JSON') from None
    if not isinstance(arguments, dict):
        raise ValueError('the "arguments" of a tool call must be a JSON object')
    return ToolCall(payload["name"], arguments)


def _xml_value(text: str) -> Any:
    # The template writes containers as JSON and everything else with str(); strings stay
    # strings (the environment validates and converts them against its schema).
    if text[:1] in ("{", "["):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return text


def _xml_call(body: str) -> ToolCall:
    match = _XML_FUNCTION.match(body)
    if match is None:
        raise ValueError("a tool call must be <function=NAME> ... </function> inside <tool_call>")
    inner = match.group(2)
    params = _XML_PARAMETER.findall(inner)
    if _XML_PARAMETER.sub("", inner).strip():
        raise ValueError("text between the <parameter=...> blocks of a tool call")
    return ToolCall(
        match.group(1).strip(), {key.strip(): _xml_value(value) for key, value in params}
    )


def parse_tool_calls(text: str, fmt: ToolCallFormat, *, complete: bool = True) -> ParsedToolCalls:
    """The tool calls in an assistant text (the part after any reasoning block).

    `complete=False` marks a response that was cut off: a trailing unclosed `<tool_call>` is then
    dropped rather than reported as an error.
    """
    first = text.find(TOOL_CALL_OPEN)
    if first < 0:
        return ParsedToolCalls(text)
    content = text[:first]
    # The templates put "\n" (json) or "\n\n" (xml) between content and the first call.
    content = content.rstrip("\n") if fmt == "xml" else content.removesuffix("\n")
    read = _json_call if fmt == "json" else _xml_call
    calls: list[ToolCall] = []
    position = first
    while (start := text.find(TOOL_CALL_OPEN, position)) >= 0:
        end = _json_call_end(text, start) if fmt == "json" else text.find(TOOL_CALL_CLOSE, start)
        if end < 0:
            if complete:
                return ParsedToolCalls(content, tuple(calls), "a <tool_call> block is never closed")
            break
        try:
            calls.append(read(text[start + len(TOOL_CALL_OPEN) : end].strip("\n")))
        except ValueError as exc:
            return ParsedToolCalls(content, tuple(calls), str(exc))
        position = end + len(TOOL_CALL_CLOSE)
    return ParsedToolCalls(content, tuple(calls))


def _json_call_end(text: str, start: int) -> int:
    """Where the close tag of the call opened at `start` begins: after its JSON object, so that a
    `</tool_call>` inside one of its strings (which the tool-call grammar allows) does not end it.
    A body that is not JSON ends at the first close tag, and `_json_call` reports it."""
    body = start + len(TOOL_CALL_OPEN)
    body += len(text[body:]) - len(text[body:].lstrip())
    try:
        _, after = json.JSONDecoder().raw_decode(text, body)
    except ValueError:
        after = start
    return text.find(TOOL_CALL_CLOSE, after)


def detect_tool_call_format(chat_template: str) -> ToolCallFormat | None:
    """The tool-call format a chat template writes, or None when it is not a known one."""
    if "<function=" in chat_template and TOOL_CALL_OPEN in chat_template:
        return "xml"
    if TOOL_CALL_OPEN in chat_template and '"arguments"' in chat_template:
        return "json"
    return None


def hf_message(message: Message) -> dict[str, Any]:
    """`message` in the dict shape Hugging Face chat templates expect."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "type": "function",
                "id": c.id,
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out
