"""OpenAI Responses (`POST /v1/responses`), stateless: the proxy keeps no responses, so a client
sends the whole conversation in `input` every time (`previous_response_id` is refused), as
agents that run with `store: false` do anyway.

One completion's output items (reasoning, a message, function calls) come back in later inputs;
read in a row they become the one assistant message they were parsed from, so the proxy can
match the conversation with what it sampled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from plait.api import Message, ToolCall
from plait_proxy.chat import ChatRequest, Choice, Completion, RequestError
from plait_proxy.openai_common import (
    Fields,
    call_id,
    checked_text,
    common_options,
    dump_arguments,
    error_body,
    parse_arguments,
    pieces,
    read_tool_choice,
    read_tools,
    text_parts,
    to_json,
    token_logprobs,
    unknown_call,
)

__all__ = ["error_body", "parse_request", "response_body", "stream_events"]

_MESSAGE_ROLES: dict[str, Any] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}
_TEXT_PARTS = ("input_text", "output_text")
_LOGPROBS = "message.output_text.logprobs"
_STATELESS = "the proxy keeps no conversations: send the whole conversation in `input`"


def parse_request(body: Any) -> ChatRequest:
    """A Responses body as a ChatRequest, or a RequestError naming the first wrong field."""
    fields = Fields(body)
    model = fields.required_text("model")
    for key in ("previous_response_id", "conversation"):
        fields.refuse_unless(key, None, _STATELESS)
    fields.refuse_unless(
        "background", False, "responses are answered within the request; leave it out"
    )
    instructions = fields.text("instructions")
    messages = [Message("system", instructions)] if instructions else []
    messages += _input(fields)
    tools = read_tools(fields, _flat_function)
    tool_choice = read_tool_choice(
        fields, tools, lambda choice: choice, '{"type": "function", "name": ...}'
    )
    options = common_options(fields, ("max_output_tokens",))
    text = fields.obj("text")
    if text is not None:
        text.refuse_unless(
            "format",
            {"type": "text"},
            'the engine does not constrain decoding; send {"type": "text"} or leave it out',
        )
    fields.obj("reasoning")  # an object, when sent; the model reasons as its template says
    fields.text("prompt_cache_key")
    extra: dict[str, Any] = {  # what the response echoes
        "instructions": instructions,
        "parallel_tool_calls": fields.flag("parallel_tool_calls"),
        "metadata": fields.string_map("metadata"),
        "truncation": fields.choice("truncation", ("auto", "disabled")),
    }
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        logprobs=_LOGPROBS in _include(fields),
        **options,
        extra={key: value for key, value in extra.items() if value is not None},
    )


def _flat_function(tool: Fields) -> Fields:
    if tool.get("name") is None and tool.get("function") is not None:
        raise RequestError(
            "Responses tools are flat: send "
            '{"type": "function", "name": ..., "parameters": ...}, without a `function` object',
            param=tool.param("name"),
        )
    return tool


def _include(fields: Fields) -> list[str]:
    include = fields.items("include") or []
    for i, value in enumerate(include):
        if not isinstance(value, str):
            raise RequestError(f"`include[{i}]` must be a string", param=f"include[{i}]")
    return include


def _input(fields: Fields) -> list[Message]:
    value = fields.required("input", "a string or a list of input items")
    if isinstance(value, str):
        return [Message("user", checked_text(value, "input"))]
    items = fields.items("input") or []
    if not items:
        raise RequestError(
            "`input` is empty: send a string or a non-empty list of input items", param="input"
        )
    transcript = _Transcript()
    for i, item in enumerate(items):
        transcript.add(Fields(item, f"input[{i}]"))
    return transcript.messages


@attrs.define
class _Transcript:
    """Input items read into messages. A reasoning item starts a completion's output; the
    message and function calls after it join the same assistant message."""

    messages: list[Message] = attrs.field(factory=list)
    call_names: dict[str, str] = attrs.field(factory=dict)
    """Tool results name the tool their call named."""
    reasoning: str | None = None
    """The text of a reasoning item that no message has taken yet."""
    assistant_open: bool = False
    """The last message is an assistant's and may still take function calls."""

    def add(self, item: Fields) -> None:
        kind = item.get("type")
        if kind == "message" or (kind is None and "role" in item.value):
            self._message(item)
        elif kind == "function_call":
            self._function_call(item)
        elif kind == "reasoning":
            self.reasoning, self.assistant_open = _reasoning_text(item), False
        elif kind == "function_call_output":
            self._close()
            tool_call_id = item.required_text("call_id")
            output = text_parts(
                item.required("output", "a string or a list of text parts"),
                item.param("output"),
                _TEXT_PARTS,
            )
            if tool_call_id not in self.call_names:
                raise unknown_call(tool_call_id, item.param("call_id"), "function_call")
            self.messages.append(
                Message(
                    "tool",
                    output,
                    tool_call_id=tool_call_id,
                    name=self.call_names[tool_call_id],
                )
            )
        else:
            what = (
                f"items of type {kind[:40]!r} are"
                if isinstance(kind, str)
                else "items without a `type` are"
            )
            raise RequestError(
                f"`{item.param('type')}`: {what} not supported: send message, function_call, "
                "function_call_output or reasoning items (the whole conversation, no references)",
                param=item.param("type"),
            )

    def _message(self, item: Fields) -> None:
        role = item.required_text("role")
        if role not in _MESSAGE_ROLES:
            raise RequestError(
                f"`{item.param('role')}` must be one of "
                f"{', '.join(repr(r) for r in _MESSAGE_ROLES)}, got {role[:40]!r}",
                param=item.param("role"),
            )
        content = text_parts(
            item.required("content", "a string or a list of text parts"),
            item.param("content"),
            _TEXT_PARTS,
        )
        if role == "assistant":
            self._open(Message("assistant", content, reasoning_content=self.reasoning))
        else:
            self._close()
            self.messages.append(Message(_MESSAGE_ROLES[role], content))

    def _function_call(self, item: Fields) -> None:
        name, identifier = item.required_text("name"), item.required_text("call_id")
        call = ToolCall(
            name, parse_arguments(item.get("arguments"), item.param("arguments")), identifier
        )
        self.call_names[identifier] = name
        if self.assistant_open:
            last = self.messages[-1]
            self.messages[-1] = attrs.evolve(last, tool_calls=(*last.tool_calls, call))
        else:
            self._open(
                Message("assistant", "", reasoning_content=self.reasoning, tool_calls=[call])
            )

    def _open(self, message: Message) -> None:
        self.messages.append(message)
        self.reasoning, self.assistant_open = None, True

    def _close(self) -> None:
        """Anything but assistant output ends the assistant's turn (and drops a reasoning item
        that no message took)."""
        self.reasoning, self.assistant_open = None, False


def _reasoning_text(item: Fields) -> str | None:
    """A reasoning item's text: its raw reasoning, else its summary; None when only encrypted
    content came back (nothing the proxy can show the model)."""
    for key, part in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.items(key)
        if parts:
            return text_parts(parts, item.param(key), (part,))
    return None


# -- answers -----------------------------------------------------------------------------------


def response_body(request: ChatRequest, completion: Completion) -> dict[str, Any]:
    return _response(request, completion, done=True)


def _response(request: ChatRequest, completion: Completion, *, done: bool) -> dict[str, Any]:
    """The response object: finished, or as `response.created` shows it before any output."""
    choice = completion.choices[0]
    incomplete = done and choice.finish_reason == "length"
    return {
        "id": f"resp_{completion.id}",
        "object": "response",
        "created_at": completion.created,
        "status": "incomplete" if incomplete else "completed" if done else "in_progress",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.extra.get("instructions"),
        "max_output_tokens": request.max_tokens,
        "model": completion.model,
        "output": _output(request, completion.id, choice) if done else [],
        "parallel_tool_calls": request.extra.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "text": {"format": {"type": "text"}},
        "tool_choice": (
            request.tool_choice
            if request.tool_choice in ("auto", "none", "required")
            else {"type": "function", "name": request.tool_choice}
        ),
        "tools": [
            {
                "type": "function",
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.input_schema,
            }
            for tool in request.tools
        ],
        "truncation": request.extra.get("truncation", "disabled"),
        "metadata": request.extra.get("metadata", {}),
        "usage": _usage(completion) if done else None,
    }


def _output(request: ChatRequest, completion_id: str, choice: Choice) -> list[dict[str, Any]]:
    """Reasoning (when the renderer parsed some), the text (when there is some, or nothing
    else), then one item per tool call, as OpenAI orders them."""
    message = choice.message
    items: list[dict[str, Any]] = []
    if message.reasoning_content is not None:
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{completion_id}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": message.reasoning_content}],
            }
        )
    if message.content or not message.tool_calls:
        items.append(
            {
                "type": "message",
                "id": f"msg_{completion_id}",
                "role": "assistant",
                "status": "incomplete" if choice.finish_reason == "length" else "completed",
                "content": [
                    {
                        "type": "output_text",
                        "text": message.content,
                        "annotations": [],
                        "logprobs": token_logprobs(choice) if request.logprobs else [],
                    }
                ],
            }
        )
    for k, call in enumerate(message.tool_calls):
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{completion_id}_{k}",
                "call_id": call_id(call, completion_id, choice.index, k),
                "name": call.name,
                "arguments": dump_arguments(call.arguments),
                "status": "completed",
            }
        )
    return items


def _usage(completion: Completion) -> dict[str, Any]:
    return {
        "input_tokens": completion.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


Emit = Callable[..., bytes]


def stream_events(request: ChatRequest, completion: Completion) -> Iterator[bytes]:
    """The Responses event stream of the finished answer: created, in progress, each output
    item built up in pieces, then `response.completed` (`response.incomplete` when the answer
    ran out of tokens, as OpenAI ends such a stream)."""
    numbers = itertools.count()

    def emit(kind: str, **payload: Any) -> bytes:
        event = {"type": kind, "sequence_number": next(numbers), **payload}
        return f"event: {kind}\ndata: {to_json(event)}\n\n".encode()

    started = _response(request, completion, done=False)
    yield emit("response.created", response=started)
    yield emit("response.in_progress", response=started)
    final = response_body(request, completion)
    for index, item in enumerate(final["output"]):
        yield from _item_events(emit, index, item)
    yield emit(f"response.{final['status']}", response=final)


def _item_events(emit: Emit, index: int, item: dict[str, Any]) -> Iterator[bytes]:
    where = {"item_id": item["id"], "output_index": index}
    yield emit("response.output_item.added", output_index=index, item=_started(item))
    if item["type"] == "function_call":
        for piece in pieces(item["arguments"]):
            yield emit("response.function_call_arguments.delta", **where, delta=piece)
        yield emit(
            "response.function_call_arguments.done",
            **where,
            name=item["name"],
            arguments=item["arguments"],
        )
    else:
        part = item["content"][0]
        yield emit("response.content_part.added", **where, content_index=0, part=_started(part))
        if item["type"] == "message":
            for piece in pieces(part["text"]):
                yield emit(
                    "response.output_text.delta", **where, content_index=0, delta=piece, logprobs=[]
                )
            yield emit(
                "response.output_text.done",
                **where,
                content_index=0,
                text=part["text"],
                logprobs=part["logprobs"],
            )
        else:
            for piece in pieces(part["text"]):
                yield emit("response.reasoning_text.delta", **where, content_index=0, delta=piece)
            yield emit("response.reasoning_text.done", **where, content_index=0, text=part["text"])
        yield emit("response.content_part.done", **where, content_index=0, part=part)
    yield emit("response.output_item.done", output_index=index, item=item)


def _started(value: dict[str, Any]) -> dict[str, Any]:
    """An output item or content part as its `added` event shows it: in progress, no text,
    arguments or parts yet."""
    return {
        key: ""
        if key in ("text", "arguments")
        else []
        if isinstance(field, list)
        else "in_progress"
        if key == "status"
        else field
        for key, field in value.items()
    }
