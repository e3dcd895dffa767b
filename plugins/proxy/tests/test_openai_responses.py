"""The Responses wire format, checked against the real `openai` SDK: its strict models validate
every body and event, its client streams them (over a mock transport that answers as the
proxy's app does) into the same response, and its requests parse."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx2
import openai
import pydantic
import pytest
from hypothesis import given, settings, strategies as st
from openai.types.responses import Response, ResponseStreamEvent

from plait.api import Message, ParseTermination, SampledSequence, ToolCall, ToolSpec
from plait_proxy import openai_responses
from plait_proxy.chat import ChatRequest, Choice, Completion, FinishReason, RequestError

LONG = "A reply long enough to go out in several deltas: " + "ünïcødé and 🙂 " * 12

MESSAGES = {
    "text": Message("assistant", "Hello!"),
    "long text": Message("assistant", LONG),
    "empty": Message("assistant", ""),
    "reasoning": Message("assistant", "42", reasoning_content="Six times seven. " * 5),
    "reasoning and a call": Message(
        "assistant",
        "",
        reasoning_content="Look it up.",
        tool_calls=[ToolCall("search", {"q": "plait"}, "call_a")],
    ),
    "tool call": Message(
        "assistant", "", tool_calls=[ToolCall("search", {"q": "plait"}, "call_a")]
    ),
    "text and tool calls": Message(
        "assistant",
        "Let me look.",
        reasoning_content="Two lookups.",
        tool_calls=[
            ToolCall("search", {"q": "plait", "deep": {"k": [1, 2.5, None, True]}}, "call_a"),
            ToolCall("lookup", {}, "call_b"),
        ],
    ),
}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def make_choice(message: Message, finish: FinishReason = "stop", tokens: int = 5) -> Choice:
    sequence = SampledSequence(
        range(100, 100 + tokens),
        [-0.25 * (i + 1) for i in range(tokens)],
        "length" if finish == "length" else "stop",
    )
    if message.tool_calls and finish == "stop":
        finish = "tool_calls"
    return Choice(
        0,
        sequence,
        message,
        ParseTermination.EOS,
        finish,
        token_texts=[f"t{i}é" for i in range(tokens)],
    )


def make_completion(choice: Choice) -> Completion:
    return Completion("cmpl0123", "test-model", 1_700_000_000, [1, 2, 3, 4], [choice])


def parse(**fields: Any) -> ChatRequest:
    return openai_responses.parse_request({"model": "test-model", "input": "Hi", **fields})


def events(request: ChatRequest, completion: Completion) -> list[dict[str, Any]]:
    """The stream's events, each checked to be a well-formed SSE frame."""
    payloads = []
    for frame in openai_responses.stream_events(request, completion):
        head, data = frame.decode().split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ") and data.endswith("\n\n")
        payload = json.loads(data[len("data: ") :])
        assert payload["type"] == head[len("event: ") :]
        payloads.append(payload)
    return payloads


def sdk_client(
    answer: Callable[[ChatRequest], Completion], seen: list[ChatRequest] | None = None
) -> openai.OpenAI:
    """The real SDK, talking to the adapter as the proxy's app serves it."""

    def handle(http_request: httpx2.Request) -> httpx2.Response:
        try:
            request = openai_responses.parse_request(json.loads(http_request.content))
        except RequestError as error:
            return httpx2.Response(error.status, json=openai_responses.error_body(error))
        if seen is not None:
            seen.append(request)
        completion = answer(request)
        if request.stream:
            return httpx2.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content=b"".join(openai_responses.stream_events(request, completion)),
            )
        return httpx2.Response(200, json=openai_responses.response_body(request, completion))

    return openai.OpenAI(
        base_url="http://test/v1",
        api_key="x",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handle)),
    )


def answering(
    message: Message, finish: FinishReason = "stop"
) -> Callable[[ChatRequest], Completion]:
    return lambda request: make_completion(make_choice(message, finish))


# -- answers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MESSAGES)
@pytest.mark.parametrize("logprobs", [False, True])
def test_every_body_passes_the_sdks_strict_validation(name: str, logprobs: bool) -> None:
    message = MESSAGES[name]
    include = ["message.output_text.logprobs"] if logprobs else []
    body = openai_responses.response_body(
        parse(include=include), make_completion(make_choice(message))
    )
    response = Response.model_validate(body, strict=True)
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == message.content
    assert [item.type for item in response.output] == (
        ["reasoning"] * (message.reasoning_content is not None)
        + ["message"] * bool(message.content or not message.tool_calls)
        + ["function_call"] * len(message.tool_calls)
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [
        (c.id, c.name, c.arguments) for c in message.tool_calls
    ]
    reasoning = [item for item in response.output if item.type == "reasoning"]
    assert [r.content[0].text for r in reasoning if r.content] == [message.reasoning_content] * len(
        reasoning
    )
    assert response.usage is not None and (
        response.usage.input_tokens,
        response.usage.output_tokens,
        response.usage.total_tokens,
    ) == (4, 5, 9)
    texts = [item.content[0] for item in response.output if item.type == "message"]
    for text in texts:
        assert text.type == "output_text"
        assert [(p.token, p.logprob) for p in text.logprobs or []][:1] == (
            [("t0é", -0.25)] if logprobs else []
        )


def test_a_length_cut_answer_is_incomplete() -> None:
    body = openai_responses.response_body(
        parse(max_output_tokens=5), make_completion(make_choice(MESSAGES["long text"], "length"))
    )
    response = Response.model_validate(body, strict=True)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output[0].status == "incomplete"
    assert response.max_output_tokens == 5


def test_the_body_echoes_the_request() -> None:
    request = parse(
        instructions="Be brief.",
        tools=[
            {
                "type": "function",
                "name": "search",
                "description": "S.",
                "parameters": {"type": "object"},
                "strict": True,
            }
        ],
        tool_choice={"type": "function", "name": "search"},
        temperature=0.5,
        top_p=0.9,
        parallel_tool_calls=False,
        metadata={"k": "v"},
        truncation="auto",
    )
    response = Response.model_validate(
        openai_responses.response_body(request, make_completion(make_choice(MESSAGES["text"]))),
        strict=True,
    )
    assert (response.id, response.object, response.created_at, response.model) == (
        "resp_cmpl0123",
        "response",
        1_700_000_000,
        "test-model",
    )
    assert (
        response.instructions,
        response.temperature,
        response.top_p,
        response.parallel_tool_calls,
        response.metadata,
        response.truncation,
    ) == ("Be brief.", 0.5, 0.9, False, {"k": "v"}, "auto")
    assert response.tool_choice.model_dump() == {"type": "function", "name": "search"}  # type: ignore[union-attr]
    assert [t.model_dump(exclude_none=True) for t in response.tools] == [
        {
            "type": "function",
            "name": "search",
            "description": "S.",
            "parameters": {"type": "object"},
        }
    ]
    assert response.text is not None and response.text.model_dump(exclude_none=True) == {
        "format": {"type": "text"}
    }
    assert response.error is None and response.previous_response_id is None


def test_the_sdk_makes_a_plain_call() -> None:
    client = sdk_client(answering(MESSAGES["reasoning"]))
    response = client.responses.create(model="test-model", input="6*7?")
    assert response.output_text == "42"
    assert response.output[0].type == "reasoning"


# -- streams -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MESSAGES)
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_every_event_passes_strict_validation_in_openais_order(
    name: str, finish: FinishReason
) -> None:
    request = parse(stream=True, include=["message.output_text.logprobs"])
    completion = make_completion(make_choice(MESSAGES[name], finish))
    payloads = events(request, completion)
    for payload in payloads:
        EVENTS.validate_python(payload, strict=True)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    final = openai_responses.response_body(request, completion)
    status = final["status"]
    assert [p["type"] for p in payloads[:2]] == ["response.created", "response.in_progress"]
    assert (
        payloads[0]["response"]["status"] == "in_progress"
        and payloads[0]["response"]["output"] == []
    )
    assert payloads[-1] == {
        "type": f"response.{status}",
        "sequence_number": len(payloads) - 1,
        "response": final,
    }
    done = [p for p in payloads if p["type"] == "response.output_item.done"]
    assert [p["item"] for p in done] == final["output"]
    added = [p for p in payloads if p["type"] == "response.output_item.added"]
    assert [(p["output_index"], p["item"]["id"]) for p in added] == [
        (i, item["id"]) for i, item in enumerate(final["output"])
    ]


@pytest.mark.parametrize("name", MESSAGES)
def test_the_sdks_stream_helper_builds_the_body(name: str) -> None:
    """`client.responses.stream` accumulates the events, checks their identities, and ends with
    the response the non-streaming call returns."""
    client = sdk_client(answering(MESSAGES[name]))
    with client.responses.stream(
        model="test-model", input="Hi", include=["message.output_text.logprobs"]
    ) as stream:
        deltas = "".join(
            event.delta for event in stream if event.type == "response.output_text.delta"
        )
        streamed = stream.get_final_response()
    body = openai_responses.response_body(
        parse(include=["message.output_text.logprobs"]),
        make_completion(make_choice(MESSAGES[name])),
    )
    assert deltas == MESSAGES[name].content
    assert streamed.output_text == MESSAGES[name].content
    assert streamed.model_dump(exclude_none=True) == Response.model_validate(body).model_dump(
        exclude_none=True
    )


def test_plain_streamed_events_add_up_to_the_output() -> None:
    message = MESSAGES["text and tool calls"]
    client = sdk_client(answering(message))
    text, reasoning = "", ""
    arguments: dict[str, str] = {}
    for event in client.responses.create(model="test-model", input="Hi", stream=True):
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.reasoning_text.delta":
            reasoning += event.delta
        elif event.type == "response.function_call_arguments.delta":
            arguments[event.item_id] = arguments.get(event.item_id, "") + event.delta
        elif event.type == "response.completed":
            assert event.response.output_text == message.content
    assert (text, reasoning) == (message.content, message.reasoning_content)
    assert [json.loads(a) for a in arguments.values()] == [
        call.arguments for call in message.tool_calls
    ]


def test_a_length_cut_stream_ends_with_response_incomplete() -> None:
    """As OpenAI ends it; the SDK's `get_final_response` wants `response.completed` and raises,
    so clients read the last event's response instead."""
    client = sdk_client(answering(MESSAGES["long text"], "length"))
    last = list(client.responses.create(model="test-model", input="Hi", stream=True))[-1]
    assert last.type == "response.incomplete"
    assert last.response.output_text == LONG and last.response.status == "incomplete"


# -- requests ----------------------------------------------------------------------------------


def test_a_request_from_the_sdk_parses() -> None:
    seen: list[ChatRequest] = []
    client = sdk_client(answering(MESSAGES["text"]), seen)
    client.responses.create(
        model="test-model",
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Find"},
                    {"type": "input_text", "text": "plait"},
                ],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "search",
                "arguments": '{"q": "plait"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "found"},
        ],
        tools=[
            {
                "type": "function",
                "name": "search",
                "description": "Searches.",
                "strict": True,
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
            }
        ],
        tool_choice="required",
        max_output_tokens=64,
        temperature=0.5,
        top_p=0.9,
        parallel_tool_calls=True,
        store=False,
        include=["reasoning.encrypted_content"],
        metadata={"k": "v"},
        truncation="disabled",
        reasoning={"effort": "low", "summary": "auto"},
        text={"format": {"type": "text"}, "verbosity": "low"},
        user="u",
        prompt_cache_key="key",
        top_logprobs=0,
    )
    assert seen == [
        ChatRequest(
            model="test-model",
            messages=[
                Message("system", "Be brief."),
                Message("system", "Use tools."),
                Message("user", "Find\nplait"),
                Message("assistant", "", tool_calls=[ToolCall("search", {"q": "plait"}, "call_1")]),
                Message("tool", "found", tool_call_id="call_1", name="search"),
            ],
            max_tokens=64,
            tools=[
                ToolSpec(
                    "search",
                    "Searches.",
                    {"type": "object", "properties": {"q": {"type": "string"}}},
                )
            ],
            tool_choice="required",
            temperature=0.5,
            top_p=0.9,
            extra={
                "instructions": "Be brief.",
                "parallel_tool_calls": True,
                "metadata": {"k": "v"},
                "truncation": "disabled",
            },
        )
    ]


def test_a_string_input_is_one_user_message() -> None:
    assert parse(input="Hi there").messages == (Message("user", "Hi there"),)
    assert parse().extra == {}


@pytest.mark.parametrize("name", MESSAGES)
def test_an_answer_sent_back_parses_to_the_same_message(name: str) -> None:
    """What the proxy matches a continued conversation on: the output items of its own answer,
    appended to the input as agents do, read as the one message the renderer parsed."""
    message = MESSAGES[name]
    body = openai_responses.response_body(parse(), make_completion(make_choice(message)))
    results = [
        {
            "type": "function_call_output",
            "call_id": call.id,
            "output": [{"type": "input_text", "text": "ok"}],
        }
        for call in message.tool_calls
    ]
    request = parse(input=[{"role": "user", "content": "Hi"}, *body["output"], *results])
    assert request.messages[1] == message
    assert request.messages[2:] == tuple(
        Message("tool", "ok", tool_call_id=call.id, name=call.name) for call in message.tool_calls
    )


def test_the_sdks_own_output_items_parse_back() -> None:
    """Agents append `response.output` (the SDK's objects) to their next input."""
    message = MESSAGES["text and tool calls"]
    response = sdk_client(answering(message)).responses.create(model="test-model", input="Hi")
    seen: list[ChatRequest] = []
    sdk_client(answering(MESSAGES["text"]), seen).responses.create(
        model="test-model",
        input=[
            {"role": "user", "content": "Hi"},
            *response.output,  # type: ignore[list-item]
            {"type": "function_call_output", "call_id": "call_a", "output": "r1"},
            {"type": "function_call_output", "call_id": "call_b", "output": "r2"},
        ],
    )
    assert seen[0].messages[1] == message


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        (
            [
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "S"}]},
                {"role": "assistant", "content": "A"},
            ],
            [Message("assistant", "A", reasoning_content="S")],
        ),
        (
            [
                {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": ""},
            ],
            [Message("assistant", "", tool_calls=[ToolCall("f", {}, "c")])],
        ),
        (
            [{"role": "assistant", "content": "A"}, {"role": "assistant", "content": "B"}],
            [Message("assistant", "A"), Message("assistant", "B")],
        ),
        (
            [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "r"},
                {"type": "function_call", "call_id": "d", "name": "f", "arguments": "{}"},
            ],
            [
                Message("assistant", "", tool_calls=[ToolCall("f", {}, "c")]),
                Message("tool", "r", tool_call_id="c", name="f"),
                Message("assistant", "", tool_calls=[ToolCall("f", {}, "d")]),
            ],
        ),
        (
            [
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "R"}],
                },
                {"role": "user", "content": "Q"},
            ],
            [Message("user", "Q")],
        ),
        (
            [
                {"role": "assistant", "content": "A"},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": "R"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            ],
            [
                Message("assistant", "A"),
                Message(
                    "assistant", "", reasoning_content="R", tool_calls=[ToolCall("f", {}, "c")]
                ),
            ],
        ),
    ],
)
def test_one_completions_output_items_merge_into_one_message(
    items: list[Any], expected: list[Message]
) -> None:
    assert parse(input=[{"role": "user", "content": "Hi"}, *items]).messages[1:] == tuple(expected)


# -- refusals ----------------------------------------------------------------------------------

SEARCH = {"type": "function", "name": "search"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("hello", None),
        ({"input": "Hi"}, "model"),
        ({"model": "m"}, "input"),
        ({"model": "m", "input": []}, "input"),
        ({"model": "m", "input": 5}, "input"),
        ({"model": "m", "input": ["Hi"]}, "input[0]"),
        ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"model": "m", "input": [{"role": "user"}]}, "input[0].content"),
        (
            {
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            },
            "input[0].content[0].type",
        ),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_file"}]}]},
            "input[0].content[0].type",
        ),
        (
            {
                "model": "m",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": None}]}],
            },
            "input[0].content[0].text",
        ),
        ({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"model": "m", "input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        ({"model": "m", "input": [{"content": "no role, no type"}]}, "input[0].type"),
        (
            {"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        (
            {"model": "m", "input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
            "input[0].name",
        ),
        (
            {
                "model": "m",
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"}
                ],
            },
            "input[0].arguments",
        ),
        (
            {"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
            "input[0].arguments",
        ),
        (
            {"model": "m", "input": [{"type": "function_call_output", "output": "r"}]},
            "input[0].call_id",
        ),
        (
            {"model": "m", "input": [{"type": "function_call_output", "call_id": "c"}]},
            "input[0].output",
        ),
        (
            {
                "model": "m",
                "input": [{"type": "function_call_output", "call_id": "nowhere", "output": "r"}],
            },
            "input[0].call_id",
        ),
        (
            {
                "model": "m",
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "input_image"}],
                    }
                ],
            },
            "input[0].output[0].type",
        ),
        ({"model": "m", "input": [{"type": "reasoning", "summary": "S"}]}, "input[0].summary"),
        (
            {
                "model": "m",
                "input": [
                    {"type": "reasoning", "summary": [{"type": "reasoning_text", "text": "R"}]}
                ],
            },
            "input[0].summary[0].type",
        ),
        ({"model": "m", "input": "Hi", "instructions": ["x"]}, "instructions"),
        ({"model": "m", "input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"model": "m", "input": "Hi", "conversation": "conv_1"}, "conversation"),
        ({"model": "m", "input": "Hi", "background": True}, "background"),
        ({"model": "m", "input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {
                "model": "m",
                "input": "Hi",
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            "tools[0].name",
        ),
        ({"model": "m", "input": "Hi", "tools": [SEARCH, SEARCH]}, "tools[1].name"),
        (
            {"model": "m", "input": "Hi", "tools": [{**SEARCH, "parameters": []}]},
            "tools[0].parameters",
        ),
        (
            {"model": "m", "input": "Hi", "tools": [{**SEARCH, "parameters": {"type": "array"}}]},
            "tools[0].parameters",
        ),
        (
            {
                "model": "m",
                "input": "Hi",
                "tools": [SEARCH],
                "tool_choice": {"type": "function", "name": "x"},
            },
            "tool_choice.name",
        ),
        (
            {"model": "m", "input": "Hi", "tools": [SEARCH], "tool_choice": {"type": "web_search"}},
            "tool_choice",
        ),
        (
            {
                "model": "m",
                "input": "Hi",
                "tools": [SEARCH],
                "tool_choice": {"type": "function", "function": {"name": "search"}},
            },
            "tool_choice.name",
        ),
        ({"model": "m", "input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m", "input": "Hi", "temperature": -1}, "temperature"),
        ({"model": "m", "input": "Hi", "top_logprobs": 1}, "top_logprobs"),
        (
            {
                "model": "m",
                "input": "Hi",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
            },
            "text.format",
        ),
        ({"model": "m", "input": "Hi", "text": "plain"}, "text"),
        ({"model": "m", "input": "Hi", "include": "everything"}, "include"),
        ({"model": "m", "input": "Hi", "include": [1]}, "include[0]"),
        ({"model": "m", "input": "Hi", "truncation": "middle"}, "truncation"),
        ({"model": "m", "input": "Hi", "reasoning": "high"}, "reasoning"),
        ({"model": "m", "input": "Hi", "metadata": {"k": ["v"]}}, "metadata.k"),
        ({"model": "m", "input": "Hi", "store": "no"}, "store"),
        ({"model": "m", "input": "Hi", "prompt_cache_key": 5}, "prompt_cache_key"),
    ],
)
def test_a_malformed_request_is_refused_naming_the_field(body: Any, param: str | None) -> None:
    with pytest.raises(RequestError) as refused:
        openai_responses.parse_request(body)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert refused.value.message


def test_refusals_say_what_to_send() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"previous_response_id": "resp_1"}, "send the whole conversation in `input`"),
        ({"tools": [{"type": "web_search"}]}, '"web_search"'),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "flat"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "'item_reference'"),
    ]
    for fields, phrase in cases:
        with pytest.raises(RequestError, match=phrase):
            parse(**fields)


def test_the_sdk_raises_the_refusal_with_its_param() -> None:
    client = sdk_client(answering(MESSAGES["text"]))
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="test-model", input="Hi", previous_response_id="resp_1")
    assert (refused.value.param, refused.value.type) == (
        "previous_response_id",
        "invalid_request_error",
    )


# -- fuzzing -----------------------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**62, max_value=2**80)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(
        [
            "\ud800",
            "user",
            "assistant",
            "message",
            "function_call",
            "function_call_output",
            "reasoning",
            "input_text",
            "output_text",
            "{}",
            "",
        ]
    ),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "role",
                    "content",
                    "type",
                    "text",
                    "name",
                    "call_id",
                    "arguments",
                    "output",
                    "summary",
                    "parameters",
                    "format",
                    "x",
                ]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)
FIELDS = [
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "include",
    "text",
    "metadata",
    "truncation",
    "reasoning",
    "previous_response_id",
    "parallel_tool_calls",
    "store",
    "user",
    "top_logprobs",
]


def _parses_or_refuses(body: Any) -> None:
    try:
        request = openai_responses.parse_request(body)
    except RequestError as error:
        assert error.status == 400 and error.message
        return
    completion = make_completion(make_choice(MESSAGES["text and tool calls"]))
    Response.model_validate(openai_responses.response_body(request, completion), strict=True)
    for payload in events(request, completion):
        EVENTS.validate_python(payload, strict=True)


@settings(max_examples=150, deadline=None)
@given(JSON)
def test_any_json_parses_or_is_refused(body: Any) -> None:
    _parses_or_refuses(body)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=4),
    st.sampled_from(list(MESSAGES.values())),
)
def test_any_field_value_in_a_valid_request_parses_or_is_refused(
    fields: dict[str, Any], message: Message
) -> None:
    output = openai_responses.response_body(parse(), make_completion(make_choice(message)))[
        "output"
    ]
    _parses_or_refuses(
        {"model": "m", "input": [{"role": "user", "content": "Hi"}, *output], **fields}
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(JSON, min_size=1, max_size=5))
def test_any_input_items_parse_or_are_refused(items: list[Any]) -> None:
    _parses_or_refuses({"model": "m", "input": items})
