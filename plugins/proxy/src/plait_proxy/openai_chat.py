"""OpenAI Chat Completions (`POST /v1/chat/completions`), with vLLM's extensions: `top_k`,
`return_token_ids` (`prompt_token_ids` and per-choice `token_ids` in the answer) and assistant
`reasoning_content`.

Options the engine cannot honour (penalties, top logprobs, structured output, logit bias) are
refused with a 400 rather than silently ignored; fields the proxy has no use for are ignored,
as clients send many.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from plait.api import Message, ToolCall
from plait_proxy.chat import ChatRequest, Choice, Completion, RequestError
from plait_proxy.openai_common import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
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

_ROLES: dict[str, Any] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_MAX_STOPS = 16


def parse_request(body: Any) -> ChatRequest:
    """A Chat Completions body as a ChatRequest, or a RequestError naming the first wrong field."""
    fields = Fields(body)
    model = fields.required_text("model")
    messages = _messages(fields)
    tools = read_tools(fields, lambda tool: tool.required_obj("function"))
    tool_choice = read_tool_choice(
        fields,
        tools,
        lambda choice: choice.required_obj("function"),
        '{"type": "function", "function": {"name": ...}}',
    )
    options = common_options(fields, ("max_completion_tokens", "max_tokens"))
    top_k = fields.integer("top_k", -1, INT32_MAX)
    options.update(
        top_k=-1 if top_k == 0 else top_k,  # vLLM: 0 and -1 both mean off
        seed=fields.integer("seed", INT64_MIN, INT64_MAX),
        n=fields.integer("n", 1, 16),
        logprobs=fields.flag("logprobs"),
    )
    for penalty in ("frequency_penalty", "presence_penalty"):
        fields.refuse_unless(
            penalty, 0, "the engine samples without penalties; send 0 or leave it out"
        )
    fields.refuse_unless(
        "response_format",
        {"type": "text"},
        'the engine does not constrain decoding; send {"type": "text"} or leave it out',
    )
    fields.refuse_unless("logit_bias", {}, "the engine samples without logit biases; leave it out")
    stream_options = fields.obj("stream_options")
    include_usage = stream_options is not None and bool(stream_options.flag("include_usage"))
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        stop=_stop(fields),
        extra={
            "include_usage": include_usage,
            "return_token_ids": bool(fields.flag("return_token_ids")),
        },
        **{key: value for key, value in options.items() if value is not None},
    )


def _messages(fields: Fields) -> list[Message]:
    items = fields.items("messages")
    if not items:
        raise RequestError(
            "`messages` is required: send a non-empty list of messages", param="messages"
        )
    call_names: dict[str, str] = {}  # tool results name the tool their call named
    return [_message(Fields(item, f"messages[{i}]"), call_names) for i, item in enumerate(items)]


def _message(fields: Fields, call_names: dict[str, str]) -> Message:
    role = fields.required_text("role")
    if role == "function":
        raise RequestError(
            'role "function" is deprecated and not supported: send role "tool" with a '
            "`tool_call_id`",
            param=fields.param("role"),
        )
    if role not in _ROLES:
        raise RequestError(
            f"`{fields.param('role')}` must be one of "
            f"{', '.join(repr(r) for r in _ROLES)}, got {role[:40]!r}",
            param=fields.param("role"),
        )
    name = fields.text("name")
    if role == "assistant":
        return _assistant(fields, name, call_names)
    content = text_parts(
        fields.required("content", "a string or a list of text parts"),
        fields.param("content"),
        ("text",),
    )
    if role == "tool":
        tool_call_id = fields.required_text("tool_call_id")
        if tool_call_id not in call_names:
            raise unknown_call(tool_call_id, fields.param("tool_call_id"), "tool_calls")
        return Message(
            "tool", content, tool_call_id=tool_call_id, name=name or call_names[tool_call_id]
        )
    return Message(_ROLES[role], content, name=name)


def _assistant(fields: Fields, name: str | None, call_names: dict[str, str]) -> Message:
    content = fields.get("content")
    text = "" if content is None else text_parts(content, fields.param("content"), ("text",))
    reasoning = fields.text("reasoning_content")
    if reasoning is None:
        reasoning = fields.text("reasoning")
    fields.refuse_unless(
        "function_call", None, "the deprecated `function_call` is not supported: send `tool_calls`"
    )
    calls = []
    for k, item in enumerate(fields.items("tool_calls") or []):
        call = Fields(item, f"{fields.param('tool_calls')}[{k}]")
        call.choice("type", ("function",))
        function = call.required_obj("function")
        tool_name, identifier = function.required_text("name"), call.required_text("id")
        calls.append(
            ToolCall(
                tool_name,
                parse_arguments(function.get("arguments"), function.param("arguments")),
                identifier,
            )
        )
        call_names[identifier] = tool_name
    return Message("assistant", text, reasoning_content=reasoning, tool_calls=calls, name=name)


def _stop(fields: Fields) -> tuple[str, ...]:
    value = fields.get("stop")
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if (
        not isinstance(stops, list)
        or len(stops) > _MAX_STOPS
        or not all(isinstance(s, str) for s in stops)
    ):
        raise fields.fail("stop", f"a string or a list of up to {_MAX_STOPS} strings")
    return tuple(checked_text(stop, f"stop[{i}]") for i, stop in enumerate(stops))


# -- answers -----------------------------------------------------------------------------------


def response_body(request: ChatRequest, completion: Completion) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": _id(completion),
        "object": "chat.completion",
        "created": completion.created,
        "model": completion.model,
        "choices": [_choice(request, completion, choice) for choice in completion.choices],
        "usage": _usage(completion),
    }
    if request.extra.get("return_token_ids"):
        body["prompt_token_ids"] = list(completion.prompt_ids)
    return body


def _choice(request: ChatRequest, completion: Completion, choice: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": _content(choice)}
    if choice.message.reasoning_content is not None:
        message["reasoning_content"] = choice.message.reasoning_content
    if choice.message.tool_calls:
        message["tool_calls"] = [
            {
                "id": call_id(call, completion.id, choice.index, k),
                "type": "function",
                "function": {"name": call.name, "arguments": dump_arguments(call.arguments)},
            }
            for k, call in enumerate(choice.message.tool_calls)
        ]
    return {"index": choice.index, "message": message, **_ending(request, choice)}


def _content(choice: Choice) -> str | None:
    """The message text; null for a message of only tool calls, as OpenAI writes it."""
    if choice.message.tool_calls and not choice.message.content:
        return None
    return choice.message.content


def _ending(request: ChatRequest, choice: Choice) -> dict[str, Any]:
    """What a choice ends with, in the answer and in the last chunk of its stream."""
    ending: dict[str, Any] = {
        "finish_reason": "tool_calls" if choice.message.tool_calls else choice.finish_reason,
        "logprobs": {"content": token_logprobs(choice)} if request.logprobs else None,
    }
    if request.extra.get("return_token_ids"):
        ending["token_ids"] = list(choice.sequence.tokens)
    return ending


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def _id(completion: Completion) -> str:
    return f"chatcmpl-{completion.id}"


def stream_events(request: ChatRequest, completion: Completion) -> Iterator[bytes]:
    """The answer as `chat.completion.chunk` frames, choice after choice: the role, reasoning,
    text and tool calls in pieces, the finish reason, usage (when asked) and `[DONE]`."""
    include_usage = bool(request.extra.get("include_usage"))

    def frame(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {
            "id": _id(completion),
            "object": "chat.completion.chunk",
            "created": completion.created,
            "model": completion.model,
            "choices": choices,
            **extra,
        }
        if include_usage:
            chunk.setdefault("usage", None)  # OpenAI sends null until the usage chunk
        return f"data: {to_json(chunk)}\n\n".encode()

    for choice in completion.choices:
        prompt_ids = (
            {"prompt_token_ids": list(completion.prompt_ids)}
            if request.extra.get("return_token_ids") and choice.index == 0
            else {}
        )
        for delta in _deltas(completion, choice):
            yield frame(
                [{"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}],
                **prompt_ids,
            )
            prompt_ids = {}
        yield frame([{"index": choice.index, "delta": {}, **_ending(request, choice)}])
    if include_usage:
        yield frame([], usage=_usage(completion))
    yield b"data: [DONE]\n\n"


def _deltas(completion: Completion, choice: Choice) -> Iterator[dict[str, Any]]:
    """The deltas that add up to the choice's message (as the SDKs accumulate them)."""
    message = choice.message
    yield {"role": "assistant", "content": None if _content(choice) is None else ""}
    if message.reasoning_content is not None:
        for piece in list(pieces(message.reasoning_content)) or [""]:
            yield {"reasoning_content": piece}
    for piece in pieces(message.content):
        yield {"content": piece}
    for k, call in enumerate(message.tool_calls):
        yield {
            "tool_calls": [
                {
                    "index": k,
                    "id": call_id(call, completion.id, choice.index, k),
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            ]
        }
        for piece in pieces(dump_arguments(call.arguments)):
            yield {"tool_calls": [{"index": k, "function": {"arguments": piece}}]}
