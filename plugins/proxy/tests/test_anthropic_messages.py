"""The Anthropic Messages adapter against the real `anthropic` SDK: every body validates as an
`anthropic.types.Message`, every stream reassembles (through the SDK's own client and its
accumulator) into exactly that body, an answer sent back in a history parses into the message
that was sampled, and malformed bodies fail with a RequestError naming the field."""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2  # the anthropic SDK's HTTP client (a fork of httpx): its http_client must be one
import pytest
from anthropic.types import (
    Message as SDKMessage,
    MessageParam,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    ToolResultBlockParam,
)
from hypothesis import HealthCheck, given, settings, strategies as st

from plait.api import Message, ParseTermination, SampledSequence, ToolCall, ToolSpec
from plait_proxy.anthropic_messages import error_body, parse_request, response_body, stream_events
from plait_proxy.chat import ChatRequest, Choice, Completion, FinishReason, RequestError

MODEL = "qwen3-tiny"
EVENT_TYPES: dict[str, Any] = {
    "message_start": RawMessageStartEvent,
    "content_block_start": RawContentBlockStartEvent,
    "content_block_delta": RawContentBlockDeltaEvent,
    "content_block_stop": RawContentBlockStopEvent,
    "message_delta": RawMessageDeltaEvent,
    "message_stop": RawMessageStopEvent,
}


def _body(**fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
        **fields,
    }


def _completion(
    message: Message,
    *,
    token_texts: tuple[str, ...] = (),
    finish: FinishReason = "stop",
    stop_string: str | None = None,
) -> Completion:
    tokens = len(token_texts) or 3
    sequence = SampledSequence(
        range(tokens), [-0.5] * tokens, "length" if finish == "length" else "stop"
    )
    choice = Choice(0, sequence, message, ParseTermination.EOS, finish, stop_string, token_texts)
    return Completion("0123456789abcdef01234567", MODEL, 1_700_000_000, [1, 2, 3, 4, 5], [choice])


def _sampled_as(raw: str, cuts: list[int]) -> tuple[str, ...]:
    """`raw` cut into token texts at the given offsets."""
    bounds = sorted({0, len(raw), *(c for c in cuts if 0 < c < len(raw))})
    return tuple(raw[a:b] for a, b in itertools.pairwise(bounds))


def _frames(completion: Completion) -> list[tuple[str, dict[str, Any]]]:
    frames = []
    for frame in stream_events(
        ChatRequest(MODEL, [Message("user", "hi")], stream=True), completion
    ):
        assert frame.endswith(b"\n\n") and frame.count(b"\n") == 3
        event_line, data_line = frame.decode().split("\n")[:2]
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        frames.append(
            (event_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: ")))
        )
    return frames


def _sdk_client(
    completion: Completion, received: list[ChatRequest] | None = None
) -> anthropic.Anthropic:
    """The real SDK client, answered by the adapter: each request the SDK sends is parsed with
    `parse_request` (and kept in `received`) and answered with the completion as a body, a
    stream or an error."""

    def answer(request: httpx2.Request) -> httpx2.Response:
        try:
            chat = parse_request(json.loads(request.content))
        except RequestError as error:
            return httpx2.Response(error.status, json=error_body(error))
        if received is not None:
            received.append(chat)
        if chat.stream:
            return httpx2.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content=b"".join(stream_events(chat, completion)),
            )
        return httpx2.Response(200, json=response_body(chat, completion))

    return anthropic.Anthropic(
        base_url="http://test",
        api_key="x",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
    )


def _dumped(blocks: Any) -> list[dict[str, Any]]:
    return [block.model_dump(mode="json", exclude_none=True) for block in blocks]


def _reassembled(events: Iterator[Any]) -> dict[str, Any]:
    """What a client that reads the raw events itself (no SDK accumulator) ends up with."""
    content: list[dict[str, Any]] = []
    json_text: dict[int, str] = {}
    message: dict[str, Any] = {}
    for event in events:
        if event.type == "message_start":
            message = event.message.model_dump(mode="json", exclude_unset=True)
        elif event.type == "content_block_start":
            assert event.index == len(content)
            content.append(event.content_block.model_dump(mode="json", exclude_unset=True))
        elif event.type == "content_block_delta":
            block, delta = content[event.index], event.delta
            if delta.type == "text_delta":
                block["text"] += delta.text
            elif delta.type == "thinking_delta":
                block["thinking"] += delta.thinking
            elif delta.type == "signature_delta":
                block["signature"] = delta.signature
            else:
                json_text[event.index] = json_text.get(event.index, "") + delta.partial_json
        elif event.type == "content_block_stop" and event.index in json_text:
            content[event.index]["input"] = json.loads(json_text[event.index])
        elif event.type == "message_delta":
            message.update(
                event.delta.model_dump(mode="json", include={"stop_reason", "stop_sequence"})
            )
            message["usage"]["output_tokens"] = event.usage.output_tokens
    return {**message, "content": content}


def _check_against_sdk(completion: Completion) -> SDKMessage:
    """The body validates; the stream's frames validate event by event; the SDK's stream helper
    and a raw create(stream=True) both reassemble exactly the body."""
    body = response_body(ChatRequest(MODEL, [Message("user", "hi")]), completion)
    message = SDKMessage.model_validate(body)
    assert message.model_dump(mode="json", exclude_unset=True) == body

    frames = _frames(completion)
    assert [name for name, _ in frames[:2]] == ["message_start", "ping"]
    assert frames[-1][0] == "message_stop"
    for name, data in frames:
        assert data["type"] == name
        if name != "ping":
            EVENT_TYPES[name].model_validate(data)

    client = _sdk_client(completion)
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert client.messages.create(**request).model_dump(mode="json", exclude_unset=True) == body
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert _dumped(final.content) == _dumped(message.content)
    assert (final.stop_reason, final.stop_sequence, final.usage.output_tokens) == (
        message.stop_reason,
        message.stop_sequence,
        message.usage.output_tokens,
    )
    assert _reassembled(client.messages.create(**request, stream=True)) == body
    return message


def _history_with(content: Any, *after: dict[str, Any]) -> dict[str, Any]:
    return _body(
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": content},
            *after,
        ]
    )


# -- Requests ---------------------------------------------------------------------------------


def test_a_minimal_request_takes_anthropic_defaults() -> None:
    request = parse_request(_body())
    assert request == ChatRequest(MODEL, [Message("user", "hi")], max_tokens=64)
    assert (request.temperature, request.top_p, request.top_k, request.n, request.stream) == (
        1.0,
        1.0,
        -1,
        1,
        False,
    )


def test_every_field_a_client_may_send_is_read_or_ignored() -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    request = parse_request(
        _body(
            system=[
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Answer in English."},
            ],
            tools=[
                {
                    "name": "search",
                    "description": "Search the web.",
                    "input_schema": schema,
                    "cache_control": {"type": "ephemeral"},
                },
                {"type": "custom", "name": "clock", "input_schema": {"type": "object"}},
            ],
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
            stop_sequences=["\n\nHuman:", "END"],
            temperature=0,
            top_p=0.9,
            top_k=40,
            stream=True,
            metadata={"user_id": "session-7"},
            thinking={"type": "enabled", "budget_tokens": 1024},
            service_tier="auto",
            container=None,
            mcp_servers=[],
            output_config={"effort": "low"},
            some_future_field={"x": 1},
        )
    )
    assert request.messages == (
        Message("system", "Be brief.\nAnswer in English."),
        Message("user", "hi"),
    )
    assert request.tools == (
        ToolSpec("search", "Search the web.", schema),
        ToolSpec("clock", "", {"type": "object"}),
    )
    assert (
        request.tool_choice,
        request.stop,
        request.temperature,
        request.top_p,
        request.top_k,
        request.stream,
    ) == ("required", ("\n\nHuman:", "END"), 0.0, 0.9, 40, True)


def test_nulls_stand_for_absent_optional_fields() -> None:
    nulls = dict.fromkeys(
        [
            "system",
            "tools",
            "tool_choice",
            "stop_sequences",
            "temperature",
            "top_p",
            "top_k",
            "stream",
            "metadata",
            "thinking",
            "mcp_servers",
        ]
    )
    assert parse_request(_body(**nulls)) == parse_request(_body())


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "clock", "disable_parallel_tool_use": False}, "clock"),
    ],
)
def test_tool_choice_maps_onto_plait_terms(choice: dict[str, Any], expected: str) -> None:
    tools = [{"name": "clock", "input_schema": {"type": "object"}}]
    assert parse_request(_body(tools=tools, tool_choice=choice)).tool_choice == expected


def test_a_user_turn_of_tool_results_becomes_tool_messages_before_its_text() -> None:
    request = parse_request(
        _body(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "What time is it, and the weather?"}],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "Two tools.", "signature": "c2ln"},
                        {"type": "text", "text": "Let me check."},
                        {"type": "tool_use", "id": "toolu_1", "name": "clock", "input": {}},
                        {
                            "type": "tool_use",
                            "id": "toolu_2",
                            "name": "weather",
                            "input": {"city": "Oslo"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": "12:00",
                            "cache_control": {"type": "ephemeral"},
                        },
                        {"type": "text", "text": "Also, be quick."},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "is_error": True,
                            "content": [
                                {"type": "text", "text": "error:"},
                                {"type": "text", "text": "no such city"},
                            ],
                        },
                    ],
                },
            ]
        )
    )
    assert request.messages == (
        Message("user", "What time is it, and the weather?"),
        Message(
            "assistant",
            "Let me check.",
            reasoning_content="Two tools.",
            tool_calls=[
                ToolCall("clock", {}, "toolu_1"),
                ToolCall("weather", {"city": "Oslo"}, "toolu_2"),
            ],
        ),
        Message("tool", "12:00", tool_call_id="toolu_1", name="clock"),
        Message("tool", "error:\nno such city", tool_call_id="toolu_2", name="weather"),
        Message("user", "Also, be quick."),
    )


def test_a_user_turn_of_only_tool_results_adds_no_user_message() -> None:
    request = parse_request(
        _history_with(
            [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
        )
    )
    assert request.messages[-1] == Message("tool", "", tool_call_id="t", name="f")


def test_assistant_blocks_fold_into_one_message_and_redacted_thinking_is_dropped() -> None:
    request = parse_request(
        _history_with(
            [
                {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
                {"type": "thinking", "thinking": "First.", "signature": ""},
                {"type": "text", "text": "Part one."},
                {"type": "tool_use", "id": "a", "name": "f", "input": {"n": 1}},
                {"type": "thinking", "thinking": "Then.", "signature": "x"},
                {"type": "text", "text": "Part two.", "citations": None},
            ]
        )
    )
    assert request.messages[-1] == Message(
        "assistant",
        "Part one.\nPart two.",
        reasoning_content="First.\nThen.",
        tool_calls=[ToolCall("f", {"n": 1}, "a")],
    )
    only_redacted = parse_request(_history_with([{"type": "redacted_thinking", "data": "x"}]))
    assert only_redacted.messages[-1] == Message("assistant", "")


def test_system_messages_in_the_conversation_are_kept_where_they_are() -> None:
    """SDK 2.x has a `system` role in `messages`, for instructions given mid-conversation."""
    request = parse_request(
        _body(
            system="First.",
            messages=[
                {"role": "user", "content": "a"},
                {"role": "system", "content": [{"type": "text", "text": "Now in French."}]},
                {"role": "user", "content": "b"},
            ],
        )
    )
    assert request.messages == (
        Message("system", "First."),
        Message("user", "a"),
        Message("system", "Now in French."),
        Message("user", "b"),
    )


def test_consecutive_turns_of_one_role_are_kept_as_sent() -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "user", "content": []},
        {"role": "assistant", "content": "b"},
    ]
    assert parse_request(_body(messages=messages)).messages == (
        Message("user", "a"),
        Message("user", ""),
        Message("assistant", "b"),
    )


def _without(field: str) -> dict[str, Any]:
    body = _body()
    del body[field]
    return body


def _user(*blocks: Any) -> dict[str, Any]:
    return _body(messages=[{"role": "user", "content": list(blocks)}])


def _assistant(*blocks: Any) -> dict[str, Any]:
    return _history_with(list(blocks))


SCHEMA = {"type": "object"}
MALFORMED: list[tuple[str, Any, str | None, str]] = [
    ("not an object", [], None, "JSON object"),
    ("no model", _without("model"), "model", "required"),
    ("empty model", _body(model=""), "model", "must not be empty"),
    ("no max_tokens", _without("max_tokens"), "max_tokens", "required"),
    ("zero max_tokens", _body(max_tokens=0), "max_tokens", ">= 1"),
    ("float max_tokens", _body(max_tokens=16.0), "max_tokens", "integer"),
    ("boolean max_tokens", _body(max_tokens=True), "max_tokens", "integer"),
    ("no messages", _without("messages"), "messages", "required"),
    ("empty messages", _body(messages=[]), "messages", "at least one"),
    ("message not an object", _body(messages=["hi"]), "messages.0", "object"),
    (
        "tool role",
        _body(messages=[{"role": "tool", "content": "x"}]),
        "messages.0.role",
        '"user", "assistant" or',
    ),
    (
        "system message of a tool change",
        _body(messages=[{"role": "system", "content": [{"type": "tool_removal"}]}]),
        "messages.0.content.0",
        "a system message holds text blocks",
    ),
    (
        "role an array",
        _body(messages=[{"role": ["user"], "content": "x"}]),
        "messages.0.role",
        "an array",
    ),
    ("no content", _body(messages=[{"role": "user"}]), "messages.0.content", "required"),
    (
        "content a number",
        _body(messages=[{"role": "user", "content": 7}]),
        "messages.0.content",
        "a string or",
    ),
    (
        "image",
        _user(
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
        ),
        "messages.0.content.0",
        "text-only",
    ),
    ("document", _user({"type": "document", "source": {}}), "messages.0.content.0", "text-only"),
    ("untyped block", _user({"text": "x"}), "messages.0.content.0.type", "required"),
    ("block a string", _user("x"), "messages.0.content.0", "object"),
    (
        "text not a string",
        _user({"type": "text", "text": None}),
        "messages.0.content.0.text",
        "string",
    ),
    (
        "tool_use from the user",
        _user({"type": "tool_use", "id": "a", "name": "f", "input": {}}),
        "messages.0.content.0",
        "text and tool_result",
    ),
    (
        "thinking from the user",
        _user({"type": "thinking", "thinking": "x"}),
        "messages.0.content.0",
        "user message",
    ),
    (
        "tool_result without an id",
        _user({"type": "tool_result", "content": "x"}),
        "messages.0.content.0.tool_use_id",
        "string",
    ),
    (
        "tool_result of an image",
        _user({"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}),
        "messages.0.content.0.content.0",
        "text-only",
    ),
    (
        "tool_result content a number",
        _user({"type": "tool_result", "tool_use_id": "a", "content": 3}),
        "messages.0.content.0.content",
        "list of text blocks",
    ),
    (
        "tool_result answering no tool_use",
        _user({"type": "tool_result", "tool_use_id": "a", "content": "12:00"}),
        "messages.0.content.0.tool_use_id",
        "must answer a `tool_use` block",
    ),
    (
        "tool_result is_error a string",
        _user({"type": "tool_result", "tool_use_id": "a", "is_error": "yes"}),
        "messages.0.content.0.is_error",
        "true or false",
    ),
    (
        "tool_result from the assistant",
        _assistant({"type": "tool_result", "tool_use_id": "a"}),
        "messages.1.content.0",
        "assistant message holds",
    ),
    (
        "tool_use without input",
        _assistant({"type": "tool_use", "id": "a", "name": "f"}),
        "messages.1.content.0.input",
        "object",
    ),
    (
        "tool_use input as JSON text",
        _assistant({"type": "tool_use", "id": "a", "name": "f", "input": "{}"}),
        "messages.1.content.0.input",
        "object",
    ),
    (
        "tool_use without id",
        _assistant({"type": "tool_use", "name": "f", "input": {}}),
        "messages.1.content.0.id",
        "string",
    ),
    (
        "tool_use with empty name",
        _assistant({"type": "tool_use", "id": "a", "name": "", "input": {}}),
        "messages.1.content.0.name",
        "empty",
    ),
    (
        "thinking without text",
        _assistant({"type": "thinking", "signature": "s"}),
        "messages.1.content.0.thinking",
        "string",
    ),
    (
        "thinking signature a number",
        _assistant({"type": "thinking", "thinking": "t", "signature": 1}),
        "messages.1.content.0.signature",
        "string",
    ),
    (
        "redacted_thinking without data",
        _assistant({"type": "redacted_thinking"}),
        "messages.1.content.0.data",
        "string",
    ),
    (
        "server_tool_use",
        _assistant({"type": "server_tool_use", "id": "a", "name": "web_search", "input": {}}),
        "messages.1.content.0",
        '"server_tool_use" blocks',
    ),
    ("system a number", _body(system=3), "system", "a string or"),
    ("system block of an image", _body(system=[{"type": "image"}]), "system.0", "text-only"),
    (
        "system text not a string",
        _body(system=[{"type": "text", "text": 1}]),
        "system.0.text",
        "string",
    ),
    ("tools an object", _body(tools={"name": "f"}), "tools", "list of"),
    (
        "web search server tool",
        _body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "tools.0.type",
        "web_search_20250305",
    ),
    (
        "bash server tool",
        _body(tools=[{"type": "bash_20250124", "name": "bash"}]),
        "tools.0.type",
        '"bash_20250124" (named "bash")',
    ),
    ("tool without schema", _body(tools=[{"name": "f"}]), "tools.0.input_schema", "object"),
    (
        "tool schema not a schema",
        _body(tools=[{"name": "f", "input_schema": {"type": "object", "required": "x"}}]),
        "tools.0.input_schema",
        "not a valid JSON Schema",
    ),
    ("tool without name", _body(tools=[{"input_schema": SCHEMA}]), "tools.0.name", "string"),
    (
        "tool description a number",
        _body(tools=[{"name": "f", "description": 1, "input_schema": SCHEMA}]),
        "tools.0.description",
        "string",
    ),
    (
        "duplicate tools",
        _body(tools=[{"name": "f", "input_schema": SCHEMA}] * 2),
        "tools.1.name",
        "unique",
    ),
    ("tool_choice a string", _body(tool_choice="auto"), "tool_choice", "object"),
    ("unknown tool_choice", _body(tool_choice={"type": "required"}), "tool_choice.type", '"any"'),
    (
        "tool_choice type an array",
        _body(tool_choice={"type": ["tool"]}),
        "tool_choice.type",
        "an array",
    ),
    (
        "tool_choice of an undeclared tool",
        _body(tool_choice={"type": "tool", "name": "g"}),
        "tool_choice.name",
        "not one of the tools",
    ),
    (
        "tool_choice of a tool named like a keyword",
        _body(
            tools=[{"name": "none", "input_schema": SCHEMA}],
            tool_choice={"type": "tool", "name": "none"},
        ),
        "tool_choice.name",
        "rename",
    ),
    ("tool_choice without name", _body(tool_choice={"type": "tool"}), "tool_choice.name", "string"),
    (
        "disable_parallel_tool_use a string",
        _body(tool_choice={"type": "auto", "disable_parallel_tool_use": "y"}),
        "tool_choice.disable_parallel_tool_use",
        "true or false",
    ),
    ("temperature above 1", _body(temperature=1.5), "temperature", "from 0 to 1"),
    ("negative temperature", _body(temperature=-0.1), "temperature", "from 0 to 1"),
    ("temperature a string", _body(temperature="0.5"), "temperature", "number"),
    ("temperature a boolean", _body(temperature=True), "temperature", "got true"),
    ("huge temperature", _body(temperature=10**400), "temperature", "a huge number"),
    ("NaN temperature", _body(temperature=float("nan")), "temperature", "got NaN"),
    ("zero top_p", _body(top_p=0), "top_p", "greater than 0 and at most 1, got 0"),
    ("zero top_k", _body(top_k=0), "top_k", ">= 1, got 0"),
    ("fractional top_k", _body(top_k=2.5), "top_k", "integer"),
    ("stop_sequences a string", _body(stop_sequences="END"), "stop_sequences", "list of strings"),
    ("empty stop sequence", _body(stop_sequences=["x", ""]), "stop_sequences.1", "empty"),
    ("stop sequence a number", _body(stop_sequences=[1]), "stop_sequences.0", "string"),
    ("stream a string", _body(stream="true"), "stream", "true or false"),
    ("metadata a string", _body(metadata="u"), "metadata", "object"),
    ("metadata user_id a number", _body(metadata={"user_id": 5}), "metadata.user_id", "string"),
    ("thinking a boolean", _body(thinking=True), "thinking", "object"),
    ("thinking without type", _body(thinking={"budget_tokens": 10}), "thinking.type", "string"),
    (
        "mcp servers",
        _body(mcp_servers=[{"type": "url", "url": "https://x", "name": "x"}]),
        "mcp_servers",
        "not supported",
    ),
    ("mcp_servers an object", _body(mcp_servers={}), "mcp_servers", "not supported"),
]


@pytest.mark.parametrize(
    ("body", "param", "says"), [case[1:] for case in MALFORMED], ids=[c[0] for c in MALFORMED]
)
def test_a_malformed_body_names_its_field(body: Any, param: str | None, says: str) -> None:
    with pytest.raises(RequestError) as raised:
        parse_request(body)
    error = raised.value
    assert (error.param, error.status, error.kind) == (param, 400, "invalid_request_error")
    assert says in error.message
    assert param is None or error.message.startswith(f"{param}: ")


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.just(10**400)
    | st.floats()
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
FULL_BODY = _body(
    system=[{"type": "text", "text": "s"}],
    messages=[
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "t", "signature": ""},
                {"type": "text", "text": "a"},
                {"type": "tool_use", "id": "x", "name": "f", "input": {"k": [1]}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "x",
                    "is_error": False,
                    "content": [{"type": "text", "text": "r"}],
                }
            ],
        },
    ],
    tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
    tool_choice={"type": "tool", "name": "f"},
    stop_sequences=["z"],
    temperature=0.5,
    top_p=0.5,
    top_k=5,
    stream=False,
    metadata={"user_id": "u"},
    thinking={"type": "disabled"},
    mcp_servers=[],
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    children = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, child in children:
        yield from _paths(child, (*prefix, key))


def _parses_or_says_why(body: Any) -> None:
    try:
        assert isinstance(parse_request(body), ChatRequest)
    except RequestError as error:
        assert error.status == 400 and error.message


@settings(max_examples=300, deadline=None)
@given(body=JSON)
def test_arbitrary_json_is_parsed_or_refused_with_a_request_error(body: Any) -> None:
    _parses_or_says_why(body)


@settings(max_examples=500, deadline=None)
@given(path=st.sampled_from(list(_paths(FULL_BODY))[1:]), replacement=JSON, delete=st.booleans())
def test_a_valid_body_with_any_field_broken_is_parsed_or_refused(
    path: tuple[Any, ...], replacement: Any, delete: bool
) -> None:
    body = copy.deepcopy(FULL_BODY)
    parent = body
    for key in path[:-1]:
        parent = parent[key]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    _parses_or_says_why(body)


def test_the_full_fuzzing_body_is_valid() -> None:
    assert parse_request(FULL_BODY).tool_choice == "f"


# -- Responses --------------------------------------------------------------------------------


RAW = "<think>\nAdd them: 2 + 2 = 4.\n</think>\n\nThe answer is 4.<|im_end|>"
REASONED = Message("assistant", "The answer is 4.", reasoning_content="Add them: 2 + 2 = 4.")
CALLING = Message(
    "assistant",
    "",
    tool_calls=[
        ToolCall(
            "weather",
            {"city": "Zürich", "days": [1, 2], "units": {"temp": "C"}, "note": 'say "hi"\n'},
            "call_a_0_0",
        ),
        ToolCall("clock", {}, "call_a_0_1"),
    ],
)
COMPLETIONS = {
    "text": _completion(
        Message("assistant", "Hello there!"), token_texts=("Hello", " there", "!", "<|im_end|>")
    ),
    "reasoning and text": _completion(
        REASONED, token_texts=_sampled_as(RAW, list(range(0, len(RAW), 3)))
    ),
    "empty reasoning": _completion(Message("assistant", "ok", reasoning_content="")),
    "tool calls": _completion(CALLING, finish="tool_calls"),
    "text and a tool call": _completion(
        Message("assistant", "Checking.", tool_calls=CALLING.tool_calls[:1]), finish="tool_calls"
    ),
    "stop sequence": _completion(
        Message("assistant", "Step 1"),
        stop_string="\n\nStep 2",
        token_texts=("Step", " 1", "\n\n", "Step", " 2"),
    ),
    "max tokens": _completion(Message("assistant", "I was cut"), finish="length"),
    "nothing": _completion(Message("assistant", "")),
    "unicode without token texts": _completion(
        Message("assistant", "中文 😀 \u200b é", reasoning_content="ß")
    ),
    "rewritten by the renderer": _completion(
        Message("assistant", "trimmed"), token_texts=("  trim", "med  ")
    ),
}


@pytest.mark.parametrize("completion", COMPLETIONS.values(), ids=COMPLETIONS.keys())
def test_bodies_validate_and_streams_reassemble_them_in_the_sdk(completion: Completion) -> None:
    _check_against_sdk(completion)


def test_the_body_says_what_was_sampled() -> None:
    body = response_body(ChatRequest(MODEL, []), COMPLETIONS["reasoning and text"])
    assert body["id"] == "msg_0123456789abcdef01234567"
    assert body["content"] == [
        {"type": "thinking", "thinking": "Add them: 2 + 2 = 4.", "signature": ""},
        {"type": "text", "text": "The answer is 4."},
    ]
    assert (body["stop_reason"], body["stop_sequence"], body["model"]) == ("end_turn", None, MODEL)
    n_tokens = len(COMPLETIONS["reasoning and text"].choices[0].sequence.tokens)
    assert body["usage"] == {
        "input_tokens": 5,
        "output_tokens": n_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


@pytest.mark.parametrize(
    ("case", "content_types", "stop_reason", "stop_sequence"),
    [
        ("tool calls", ["tool_use", "tool_use"], "tool_use", None),
        ("text and a tool call", ["text", "tool_use"], "tool_use", None),
        ("stop sequence", ["text"], "stop_sequence", "\n\nStep 2"),
        ("max tokens", ["text"], "max_tokens", None),
        ("nothing", ["text"], "end_turn", None),
        ("empty reasoning", ["thinking", "text"], "end_turn", None),
    ],
)
def test_blocks_and_stop_reasons(
    case: str, content_types: list[str], stop_reason: str, stop_sequence: str | None
) -> None:
    body = response_body(ChatRequest(MODEL, []), COMPLETIONS[case])
    assert [block["type"] for block in body["content"]] == content_types
    assert (body["stop_reason"], body["stop_sequence"]) == (stop_reason, stop_sequence)


def test_a_stream_moves_a_sampled_token_at_a_time() -> None:
    frames = _frames(COMPLETIONS["text"])
    assert [d["delta"]["text"] for name, d in frames if name == "content_block_delta"] == [
        "Hello",
        " there",
        "!",
    ]
    reasoned = _frames(COMPLETIONS["reasoning and text"])
    thinking = [
        d["delta"] for name, d in reasoned if name == "content_block_delta" and d["index"] == 0
    ]
    assert "".join(d.get("thinking", "") for d in thinking) == "Add them: 2 + 2 = 4."
    assert len(thinking) > 5 and thinking[-1] == {"type": "signature_delta", "signature": ""}


def test_a_stream_starts_with_usage_and_ends_with_the_stop_reason() -> None:
    frames = _frames(COMPLETIONS["tool calls"])
    start, delta = frames[0][1]["message"], frames[-2][1]
    assert (start["content"], start["stop_reason"], start["usage"]["input_tokens"]) == ([], None, 5)
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3
    opening = [d["content_block"] for name, d in frames if name == "content_block_start"]
    assert opening[0] == {"type": "tool_use", "id": "call_a_0_0", "name": "weather", "input": {}}


def test_a_tool_call_without_an_id_gets_one_the_stream_agrees_on() -> None:
    completion = _completion(Message("assistant", "", tool_calls=[ToolCall("clock", {})]))
    body = _check_against_sdk(completion)
    assert [block.id for block in body.content if block.type == "tool_use"] == [
        "toolu_0123456789abcdef01234567_0"
    ]


def test_an_answer_sent_back_parses_into_the_message_that_was_sampled() -> None:
    for completion in COMPLETIONS.values():
        sampled = completion.choices[0].message
        body = response_body(ChatRequest(MODEL, []), completion)
        results = [
            {"type": "tool_result", "tool_use_id": call.id, "content": f"result of {call.name}"}
            for call in sampled.tool_calls
        ]
        user_turn = {"role": "user", "content": [*results, {"type": "text", "text": "thanks"}]}
        request = parse_request(_history_with(body["content"], user_turn))
        assert request.messages == (
            Message("user", "hi"),
            sampled,
            *(
                Message("tool", f"result of {c.name}", tool_call_id=c.id, name=c.name)
                for c in sampled.tool_calls
            ),
            Message("user", "thanks"),
        )


@pytest.mark.parametrize("streamed", [False, True])
def test_the_sdk_sends_an_answer_back_as_the_message_that_was_sampled(streamed: bool) -> None:
    """An agent loop's step: the SDK's `to_param` of the answer (read whole or from a stream) and a
    tool result reach the proxy as the sampled message and a tool message."""
    sampled = Message(
        "assistant",
        "Checking.",
        reasoning_content="Weather needs the tool.",
        tool_calls=CALLING.tool_calls[:1],
    )
    received: list[ChatRequest] = []
    client = _sdk_client(_completion(sampled, finish="tool_calls"), received)
    question: MessageParam = {"role": "user", "content": "weather?"}
    answer: SDKMessage
    if streamed:
        with client.messages.stream(model=MODEL, max_tokens=64, messages=[question]) as stream:
            answer = stream.get_final_message()
    else:
        answer = client.messages.create(model=MODEL, max_tokens=64, messages=[question])
    result: ToolResultBlockParam = {
        "type": "tool_result",
        "tool_use_id": "call_a_0_0",
        "content": [{"type": "text", "text": "sunny"}],
    }
    client.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[question, answer.to_param(), {"role": "user", "content": [result]}],
    )
    assert received[-1].messages == (
        Message("user", "weather?"),
        sampled,
        Message("tool", "sunny", tool_call_id="call_a_0_0", name="weather"),
    )


TEXT = st.text(
    st.sampled_from([*"abcXYZ019 .,;:!?'\"()[]{}=+-*/_\\\n\t<>", "é", "ß", "中", "😀", "\u200b"]),
    max_size=30,
)
ARGUMENT = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=10,
)


@st.composite
def _sampled_messages(draw: Any) -> Completion:
    calls = draw(
        st.lists(
            st.builds(
                ToolCall,
                st.sampled_from(["f", "search", "run_code"]),
                st.dictionaries(TEXT, ARGUMENT, max_size=4),
                TEXT.map(lambda s: f"call_{len(s)}"),
            ),
            max_size=3,
        )
    )
    message = Message(
        "assistant", draw(TEXT), reasoning_content=draw(st.none() | TEXT), tool_calls=calls
    )
    raw = f"<think>{message.reasoning_content}</think>{message.content}<tool_call>..."
    cuts = draw(st.lists(st.integers(0, len(raw)), max_size=20))
    finish: FinishReason = draw(st.sampled_from(["stop", "length"]))
    return _completion(
        message,
        token_texts=_sampled_as(raw, cuts),
        finish=finish,
        stop_string=draw(st.none() | st.just("STOP")),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(completion=_sampled_messages())
def test_any_sampled_message_survives_body_stream_and_round_trip(completion: Completion) -> None:
    _check_against_sdk(completion)
    sampled = completion.choices[0].message
    body = response_body(ChatRequest(MODEL, []), completion)
    assert parse_request(_history_with(body["content"])).messages[-1] == sampled


# -- Errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "sdk_error", "anthropic_type"),
    [
        (
            RequestError(
                "messages.0.content.0: image blocks are not supported", param="messages.0.content.0"
            ),
            anthropic.BadRequestError,
            "invalid_request_error",
        ),
        (
            RequestError("the prompt is too long", kind="context_length_exceeded"),
            anthropic.BadRequestError,
            "invalid_request_error",
        ),
        (
            RequestError("missing or wrong API key", status=401, kind="authentication_error"),
            anthropic.AuthenticationError,
            "authentication_error",
        ),
        (
            RequestError("budget spent", status=429, kind="rate_limit_error"),
            anthropic.RateLimitError,
            "rate_limit_error",
        ),
        (
            RequestError("the body is over 16 bytes", status=413),
            anthropic.APIStatusError,
            "request_too_large",
        ),
        (
            RequestError("the inference engine failed", status=502, kind="api_error"),
            anthropic.InternalServerError,
            "api_error",
        ),
    ],
)
def test_errors_reach_the_sdk_as_its_own_exceptions(
    error: RequestError, sdk_error: type[Exception], anthropic_type: str
) -> None:
    body = error_body(error)
    assert body == {"type": "error", "error": {"type": anthropic_type, "message": error.message}}
    client = anthropic.Anthropic(
        base_url="http://test",
        api_key="x",
        max_retries=0,
        http_client=httpx2.Client(
            transport=httpx2.MockTransport(lambda _: httpx2.Response(error.status, json=body))
        ),
    )
    with pytest.raises(sdk_error) as raised:
        client.messages.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert getattr(raised.value, "body", None) == body


def test_a_malformed_request_from_the_sdk_comes_back_as_bad_request() -> None:
    client = _sdk_client(COMPLETIONS["text"])
    with pytest.raises(anthropic.BadRequestError, match="text-only"):
        client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "url", "url": "https://example.com/a.png"},
                        }
                    ],
                }
            ],
        )
