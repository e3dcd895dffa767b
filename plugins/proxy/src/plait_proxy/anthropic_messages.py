"""The Anthropic Messages API (`POST /v1/messages`) in plait's terms: a request body read into a
`ChatRequest`, and a `Completion` written back as a Message body or as the server-sent events
of a stream.

Pure functions of already-parsed JSON; the HTTP app owns headers (`anthropic-version`,
`anthropic-beta`) and status codes. The engine returns whole sequences, so a stream is cut from
the finished completion: text a sampled token at a time, tool inputs in slices of their JSON.

How Anthropic's blocks map onto plait's messages:

- `system` (a string or text blocks) becomes a system message first; a `system` message inside
  `messages` (the SDK's mid-conversation instructions) becomes one where it is, and the
  renderer decides whether the model's chat template can show it there.
- A user message's `tool_result` blocks become tool messages (named after the `tool_use` they
  answer, which an earlier assistant message must hold), placed before a user message holding
  the rest of its text.
- An assistant message's `text`, `thinking` and `tool_use` blocks become one assistant message:
  its content, reasoning and tool calls. `redacted_thinking` is accepted and dropped: its data is
  encrypted, nothing a model could be shown.
- Several text (or thinking) blocks in one message are joined with newlines.
- Images, documents and server tools are refused: the proxy serves text models and client tools.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import attrs

from plait.api import Message, ToolCall, ToolSpec
from plait_proxy.chat import ChatRequest, Choice, Completion, RequestError, tool_schema_problem

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
"""Anthropic's `tool_choice.type` → ChatRequest.tool_choice (`tool` forces the tool it names)."""

_MEDIA_BLOCKS = ("image", "document", "search_result")

_JSON_SLICE = 24
"""Characters of a tool input's JSON per `input_json_delta`; any cut reassembles the same input."""

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
"""Anthropic's error type for each status it documents; SDKs pick their exception by status."""


# -- Requests ---------------------------------------------------------------------------------


def parse_request(body: Any) -> ChatRequest:
    """The request a Messages API body asks for. Anything malformed is a `RequestError` that
    names the field (`messages.2.content.0`) and what to send instead. Fields the proxy has no
    use for (`metadata`, `thinking`, `service_tier`, `container`, unknown ones) are ignored."""
    if not isinstance(body, dict):
        raise RequestError(
            f"the body must be a JSON object (a Messages API request), got {_shown(body)}"
        )
    model = _string(
        body.get("model"), "model", "the name of the model to sample from", nonempty=True
    )
    max_tokens = _integer(body.get("max_tokens"), "max_tokens", minimum=1)
    if max_tokens is None:
        _fail("max_tokens", "required: the most tokens to sample, an integer >= 1")
    messages = [*_system(body.get("system")), *_messages(body.get("messages"))]
    tools = _tools(body.get("tools"))
    _check_ignored(body)
    return ChatRequest(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=not (body.get("tool_choice") or {}).get("disable_parallel_tool_use"),
        temperature=_number(body.get("temperature"), "temperature", default=1.0, zero_allowed=True),
        top_p=_number(body.get("top_p"), "top_p", default=1.0, zero_allowed=False),
        top_k=_integer(body.get("top_k"), "top_k", minimum=1) or -1,
        stop=_stop_sequences(body.get("stop_sequences")),
        stream=_boolean(body.get("stream"), "stream"),
    )


def _check_ignored(body: dict[str, Any]) -> None:
    """Refuse what ignoring would misrepresent; the rest of the ignored fields only need to be
    of the right kind."""
    if body.get("metadata") is not None:
        metadata = _object(body["metadata"], "metadata")
        if metadata.get("user_id") is not None:
            _string(metadata["user_id"], "metadata.user_id", "an opaque id of the end user")
    if body.get("thinking") is not None:
        _string(
            _object(body["thinking"], "thinking").get("type"),
            "thinking.type",
            '"enabled" (with budget_tokens), "adaptive" or "disabled"',
        )
    servers = body.get("mcp_servers")
    if servers is not None and (not isinstance(servers, list) or servers):
        _fail(
            "mcp_servers",
            "MCP servers are not supported: the proxy runs no tools itself; "
            "declare the tools in `tools` and run them in the client",
        )


def _system(value: Any) -> list[Message]:
    return (
        []
        if value is None
        else [Message("system", _text_content(value, "system", "the system prompt"))]
    )


def _messages(value: Any) -> list[Message]:
    items = _array(value, "messages", "a list of {role, content} messages")
    if not items:
        _fail("messages", "at least one message is required")
    tool_names: dict[
        str, str
    ] = {}  # every tool call's name so far, by id, for the results that answer it
    messages: list[Message] = []
    for i, item in enumerate(items):
        param = f"messages.{i}"
        message = _object(item, param)
        role, content = message.get("role"), message.get("content")
        if "content" not in message:
            _fail(f"{param}.content", "required: a string or a list of content blocks")
        if role == "user":
            messages.extend(_user_messages(content, f"{param}.content", tool_names))
        elif role == "assistant":
            answer = _assistant_message(content, f"{param}.content")
            tool_names.update({call.id: call.name for call in answer.tool_calls if call.id})
            messages.append(answer)
        elif role == "system":
            messages.append(
                Message("system", _text_content(content, f"{param}.content", "a system message"))
            )
        else:
            _fail(f"{param}.role", f'must be "user", "assistant" or "system", got {_shown(role)}')
    return messages


def _user_messages(content: Any, param: str, tool_names: dict[str, str]) -> list[Message]:
    """A user turn: a tool message per `tool_result`, then a user message with the text (none
    when the turn only carries results)."""
    if isinstance(content, str):
        return [Message("user", content)]
    results: list[Message] = []
    texts: list[str] = []
    for j, block in enumerate(_array(content, param, "a string or a list of content blocks")):
        block_param = f"{param}.{j}"
        kind = _block_type(block, block_param)
        if kind == "text":
            texts.append(_text(block, block_param))
        elif kind == "tool_result":
            results.append(_tool_result(block, block_param, tool_names))
        else:
            _unsupported_block(
                kind, block_param, "a user message holds text and tool_result blocks"
            )
    if texts or not results:
        return [*results, Message("user", "\n".join(texts))]
    return results


def _assistant_message(content: Any, param: str) -> Message:
    if isinstance(content, str):
        return Message("assistant", content)
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(_array(content, param, "a string or a list of content blocks")):
        block_param = f"{param}.{j}"
        kind = _block_type(block, block_param)
        if kind == "text":
            texts.append(_text(block, block_param))
        elif kind == "thinking":
            thoughts.append(
                _string(block.get("thinking"), f"{block_param}.thinking", "the reasoning's text")
            )
            if block.get("signature") is not None:
                _string(
                    block["signature"],
                    f"{block_param}.signature",
                    "the signature the response gave",
                )
        elif kind == "redacted_thinking":
            _string(block.get("data"), f"{block_param}.data", "the data the response gave")
        elif kind == "tool_use":
            calls.append(
                ToolCall(
                    name=_string(
                        block.get("name"),
                        f"{block_param}.name",
                        "the name of the tool called",
                        nonempty=True,
                    ),
                    arguments=_object(block.get("input"), f"{block_param}.input"),
                    id=_string(
                        block.get("id"),
                        f"{block_param}.id",
                        "the id of the tool call",
                        nonempty=True,
                    ),
                )
            )
        else:
            _unsupported_block(
                kind,
                block_param,
                "an assistant message holds text, thinking, redacted_thinking and tool_use blocks",
            )
    return Message(
        "assistant",
        "\n".join(texts),
        reasoning_content="\n".join(thoughts) if thoughts else None,
        tool_calls=calls,
    )


def _tool_result(block: dict[str, Any], param: str, tool_names: dict[str, str]) -> Message:
    """A tool message answering a `tool_use`. `is_error` has no place in a plait message; the
    error is in the result's text, as tools write it."""
    call_id = _string(
        block.get("tool_use_id"),
        f"{param}.tool_use_id",
        "the id of the tool_use it answers",
        nonempty=True,
    )
    if block.get("is_error") is not None:
        _boolean(block["is_error"], f"{param}.is_error")
    content = block.get("content")
    text = "" if content is None else _text_content(content, f"{param}.content", "a tool result")
    if call_id not in tool_names:
        _fail(
            f"{param}.tool_use_id",
            f"unexpected `tool_use_id` found in `tool_result` blocks: {_shown(call_id)}: each "
            "`tool_result` block must answer a `tool_use` block of an earlier assistant message",
        )
    return Message("tool", text, tool_call_id=call_id, name=tool_names[call_id])


def _text_content(value: Any, param: str, holder: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(value, str):
        return value
    texts = []
    for i, block in enumerate(_array(value, param, "a string or a list of text blocks")):
        kind = _block_type(block, f"{param}.{i}")
        if kind != "text":
            _unsupported_block(kind, f"{param}.{i}", f"{holder} holds text blocks")
        texts.append(_text(block, f"{param}.{i}"))
    return "\n".join(texts)


def _text(block: dict[str, Any], param: str) -> str:
    """The text of a text block; `cache_control` and `citations` are ignored."""
    return _string(block.get("text"), f"{param}.text", "the block's text")


def _block_type(block: Any, param: str) -> str:
    """The type of a block (checked to be an object with a type)."""
    return _string(
        _object(block, param).get("type"), f"{param}.type", 'the block\'s type, e.g. "text"'
    )


def _unsupported_block(kind: str, param: str, allowed: str) -> NoReturn:
    if kind in _MEDIA_BLOCKS:
        _fail(
            param,
            f"{kind} blocks are not supported: the proxy serves a text-only model; "
            "send text blocks",
        )
    _fail(param, f"{_shown(kind)} blocks are not supported here: {allowed}")


def _tools(value: Any) -> list[ToolSpec]:
    if value is None:
        return []
    specs: list[ToolSpec] = []
    for i, item in enumerate(
        _array(value, "tools", "a list of {name, description, input_schema} tools")
    ):
        param = f"tools.{i}"
        tool = _object(item, param)
        kind = tool.get("type")
        if kind is not None and kind != "custom":
            _fail(
                f"{param}.type",
                f"server tool {_shown(kind)} (named {_shown(tool.get('name'))}) is not "
                "supported: the proxy runs no tools itself; declare a client tool "
                "{name, description, input_schema} and run it in the client",
            )
        name = _string(tool.get("name"), f"{param}.name", "the tool's name", nonempty=True)
        if any(spec.name == name for spec in specs):
            _fail(f"{param}.name", f"tool names must be unique: {_shown(name)} is declared twice")
        description = tool.get("description")
        specs.append(
            ToolSpec(
                name=name,
                description=""
                if description is None
                else _string(description, f"{param}.description", "what the tool does"),
                input_schema=_input_schema(tool.get("input_schema"), f"{param}.input_schema"),
            )
        )
    return specs


def _input_schema(value: Any, param: str) -> dict[str, Any]:
    schema = _object(value, param)
    problem = tool_schema_problem(schema)
    if problem is not None:
        _fail(
            param,
            f"not a valid JSON Schema of an object ({problem}): send the schema of the tool's "
            'input, e.g. {"type": "object", "properties": {...}}',
        )
    return schema


def _tool_choice(value: Any, tools: Sequence[ToolSpec]) -> str:
    """`auto`, `any` ("required"), `none`, or the name of the tool `tool` forces (the proxy then
    constrains decoding to calls; `disable_parallel_tool_use`: to one call)."""
    if value is None:
        return "auto"
    choice = _object(value, "tool_choice")
    if choice.get("disable_parallel_tool_use") is not None:
        _boolean(choice["disable_parallel_tool_use"], "tool_choice.disable_parallel_tool_use")
    kind = choice.get("type")
    if kind == "tool":
        name = _string(
            choice.get("name"), "tool_choice.name", "the name of the tool to call", nonempty=True
        )
        if not any(spec.name == name for spec in tools):
            _fail("tool_choice.name", f"{_shown(name)} is not one of the tools declared in `tools`")
        if name in _TOOL_CHOICES.values():
            _fail(
                "tool_choice.name",
                f"a tool forced by name cannot be called {_shown(name)} here: rename the tool",
            )
        return name
    if not isinstance(kind, str) or kind not in _TOOL_CHOICES:
        _fail("tool_choice.type", f'must be "auto", "any", "tool" or "none", got {_shown(kind)}')
    return _TOOL_CHOICES[kind]


def _stop_sequences(value: Any) -> list[str]:
    if value is None:
        return []
    sequences = _array(value, "stop_sequences", "a list of strings")
    return [
        _string(s, f"stop_sequences.{i}", "a string that ends sampling", nonempty=True)
        for i, s in enumerate(sequences)
    ]


# -- Field readers: each returns the value checked, or raises a RequestError naming the field --


def _fail(param: str, problem: str) -> NoReturn:
    raise RequestError(f"{param}: {problem}", param=param)


def _shown(value: Any) -> str:
    """A value for an error message: short scalars as JSON writes them, anything else by its JSON
    type (never a huge value echoed back)."""
    if value is None or isinstance(value, str | int | float):
        shown = (
            json.dumps(value)
            if not isinstance(value, int) or abs(value) < 10**18
            else "a huge number"
        )
        return (
            shown
            if len(shown) <= 64
            else f"a long {'string' if isinstance(value, str) else 'number'}"
        )
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _object(value: Any, param: str) -> dict[str, Any]:
    if value is None:
        _fail(param, "required: an object")
    if not isinstance(value, dict):
        _fail(param, f"must be an object, got {_shown(value)}")
    return value


def _array(value: Any, param: str, expected: str) -> list[Any]:
    if value is None:
        _fail(param, f"required: {expected}")
    if not isinstance(value, list):
        _fail(param, f"must be {expected}, got {_shown(value)}")
    return value


def _string(value: Any, param: str, expected: str, *, nonempty: bool = False) -> str:
    if value is None:
        _fail(param, f"required: a string, {expected}")
    if not isinstance(value, str):
        _fail(param, f"must be a string ({expected}), got {_shown(value)}")
    if nonempty and not value:
        _fail(param, f"must not be empty ({expected})")
    return value


def _boolean(value: Any, param: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        _fail(param, f"must be true or false, got {_shown(value)}")
    return value


def _integer(value: Any, param: str, *, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(param, f"must be an integer >= {minimum}, got {_shown(value)}")
    return value


def _number(value: Any, param: str, *, default: float, zero_allowed: bool) -> float:
    """A number in [0, 1] (or (0, 1]), compared before it is converted so that no huge integer
    overflows a float, and NaN fails every comparison."""
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (0 <= value <= 1)
        or (value == 0 and not zero_allowed)
    ):
        bounds = "from 0 to 1" if zero_allowed else "greater than 0 and at most 1"
        _fail(param, f"must be a number {bounds}, got {_shown(value)}")
    return float(value)


# -- Responses --------------------------------------------------------------------------------


@attrs.frozen
class _Block:
    """One content block of the answer, whole (for the Message body) and as a stream sends it:
    the block it opens with and the deltas that complete it."""

    whole: dict[str, Any]
    opening: dict[str, Any]
    deltas: tuple[dict[str, Any], ...]


@attrs.define
class _TokenCuts:
    """Cuts the text of a parsed field where sampled tokens end inside it, so that a stream moves
    a token at a time. Fields are looked for in the sampled text in order (reasoning before
    content); one the renderer rewrote (not there verbatim) goes whole."""

    sampled: str
    token_ends: list[int]
    searched_up_to: int = 0

    @classmethod
    def of(cls, choice: Choice) -> _TokenCuts:
        return cls(
            "".join(choice.token_texts), list(itertools.accumulate(map(len, choice.token_texts)))
        )

    def pieces(self, text: str) -> list[str]:
        if not text:
            return []
        start = self.sampled.find(text, self.searched_up_to)
        if start < 0:
            return [text]
        end = self.searched_up_to = start + len(text)
        inside = self.token_ends[
            bisect.bisect_right(self.token_ends, start) : bisect.bisect_left(self.token_ends, end)
        ]
        return [
            text[a - start : b - start]
            for a, b in itertools.pairwise([start, *inside, end])
            if b > a
        ]


def _blocks(choice: Choice, completion_id: str) -> list[_Block]:
    """A thinking block when the renderer parsed reasoning (even empty, so that the message comes
    back as it was sampled), a text block unless the text is empty and tools are called, then a
    tool_use block per call."""
    message = choice.message
    cuts = _TokenCuts.of(choice)
    blocks: list[_Block] = []
    reasoning = message.reasoning_content
    if reasoning is not None:
        blocks.append(
            _Block(
                whole={"type": "thinking", "thinking": reasoning, "signature": ""},
                opening={"type": "thinking", "thinking": "", "signature": ""},
                deltas=(
                    *(
                        {"type": "thinking_delta", "thinking": piece}
                        for piece in cuts.pieces(reasoning)
                    ),
                    {"type": "signature_delta", "signature": ""},
                ),
            )
        )
    if message.content or not message.tool_calls:
        blocks.append(
            _Block(
                whole={"type": "text", "text": message.content},
                opening={"type": "text", "text": ""},
                deltas=tuple(
                    {"type": "text_delta", "text": piece} for piece in cuts.pieces(message.content)
                ),
            )
        )
    for k, call in enumerate(message.tool_calls):
        head = {
            "type": "tool_use",
            "id": call.id or f"toolu_{completion_id}_{k}",
            "name": call.name,
        }
        arguments = json.dumps(call.arguments)
        blocks.append(
            _Block(
                whole={**head, "input": call.arguments},
                opening={**head, "input": {}},
                deltas=tuple(
                    {"type": "input_json_delta", "partial_json": arguments[i : i + _JSON_SLICE]}
                    for i in range(0, len(arguments), _JSON_SLICE)
                ),
            )
        )
    return blocks


def _stop(choice: Choice) -> tuple[str, str | None]:
    """The stop reason, and the client stop string when that is the reason (tool calls come
    first: clients loop on "tool_use")."""
    if choice.message.tool_calls:
        return "tool_use", None
    if choice.stop_string is not None:
        return "stop_sequence", choice.stop_string
    return ("max_tokens" if choice.finish_reason == "length" else "end_turn"), None


def _message(
    completion: Completion,
    content: list[dict[str, Any]],
    stop_reason: str | None,
    stop_sequence: str | None,
    output_tokens: int,
) -> dict[str, Any]:
    return {
        "id": completion.id if completion.id.startswith("msg_") else f"msg_{completion.id}",
        "type": "message",
        "role": "assistant",
        "model": completion.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(completion, output_tokens),
    }


def _usage(completion: Completion, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": completion.prompt_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def response_body(request: ChatRequest, completion: Completion) -> dict[str, Any]:
    """The Message body of a completion (n is always 1: the Messages API has no n)."""
    choice = completion.choices[0]
    return _message(
        completion,
        [block.whole for block in _blocks(choice, completion.id)],
        *_stop(choice),
        completion.completion_tokens,
    )


def stream_events(request: ChatRequest, completion: Completion) -> Iterator[bytes]:
    """Every server-sent event of the streamed completion, in Anthropic's order: message_start,
    ping, each block's start, deltas and stop, message_delta (stop reason, output tokens),
    message_stop. An SDK reassembles exactly `response_body`."""
    choice = completion.choices[0]
    yield _frame({"type": "message_start", "message": _message(completion, [], None, None, 0)})
    yield _frame({"type": "ping"})
    for index, block in enumerate(_blocks(choice, completion.id)):
        yield _frame(
            {"type": "content_block_start", "index": index, "content_block": block.opening}
        )
        for delta in block.deltas:
            yield _frame({"type": "content_block_delta", "index": index, "delta": delta})
        yield _frame({"type": "content_block_stop", "index": index})
    stop_reason, stop_sequence = _stop(choice)
    yield _frame(
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": _usage(completion, completion.completion_tokens),
        }
    )
    yield _frame({"type": "message_stop"})


def _frame(event: dict[str, Any]) -> bytes:
    """One server-sent event; ASCII JSON, so that any string (a lone surrogate included) encodes."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()


def error_body(error: RequestError) -> dict[str, Any]:
    """Anthropic's error shape, typed as Anthropic types the status (SDKs pick their exception by
    status; clients read the type): a status it has no type for keeps a kind Anthropic has, and
    anything else (e.g. OpenAI's `context_length_exceeded`) is a client or a server error."""
    kind = _ERROR_TYPES.get(error.status) or (
        error.kind
        if error.kind in _ERROR_TYPES.values()
        else "api_error"
        if error.status >= 500
        else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": error.message}}
