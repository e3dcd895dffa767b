"""The Chat Completions wire format, checked against the real `openai` SDK: its strict models
validate every body and chunk, its client streams and reassembles them (over a mock transport
that answers as the proxy's app does), and its requests parse."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx2
import openai
import pydantic
import pytest
from hypothesis import given, settings, strategies as st
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
)

from plait.api import Message, ParseTermination, SampledSequence, ToolCall, ToolSpec
from plait_proxy import openai_chat
from plait_proxy.chat import ChatRequest, Choice, Completion, FinishReason, RequestError

LONG = "A reply long enough to go out in several deltas: " + "ünïcødé and 🙂 " * 12

MESSAGES = {
    "text": Message("assistant", "Hello!"),
    "long text": Message("assistant", LONG),
    "empty": Message("assistant", ""),
    "reasoning": Message("assistant", "42", reasoning_content="Six times seven."),
    "empty reasoning": Message("assistant", "42", reasoning_content=""),
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


def make_choice(
    message: Message, finish: FinishReason = "stop", index: int = 0, tokens: int = 5
) -> Choice:
    sequence = SampledSequence(
        range(100, 100 + tokens),
        [-0.25 * (i + 1) for i in range(tokens)],
        "length" if finish == "length" else "stop",
    )
    if message.tool_calls and finish == "stop":
        finish = "tool_calls"
    return Choice(
        index,
        sequence,
        message,
        ParseTermination.EOS,
        finish,
        token_texts=[f"t{i}é" for i in range(tokens)],
    )


def make_completion(*choices: Choice) -> Completion:
    return Completion("cmpl0123", "test-model", 1_700_000_000, [1, 2, 3, 4], choices)


def parse(**fields: Any) -> ChatRequest:
    return openai_chat.parse_request(
        {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}], **fields}
    )


def frames(request: ChatRequest, completion: Completion) -> list[bytes]:
    return list(openai_chat.stream_events(request, completion))


def chunk_payloads(stream: list[bytes]) -> list[dict[str, Any]]:
    assert all(frame.startswith(b"data: ") and frame.endswith(b"\n\n") for frame in stream)
    assert stream[-1] == b"data: [DONE]\n\n"
    return [json.loads(frame[len(b"data: ") :]) for frame in stream[:-1]]


def sdk_client(
    answer: Callable[[ChatRequest], Completion], seen: list[ChatRequest] | None = None
) -> openai.OpenAI:
    """The real SDK, talking to the adapter as the proxy's app serves it."""

    def handle(http_request: httpx2.Request) -> httpx2.Response:
        try:
            request = openai_chat.parse_request(json.loads(http_request.content))
        except RequestError as error:
            return httpx2.Response(error.status, json=openai_chat.error_body(error))
        if seen is not None:
            seen.append(request)
        completion = answer(request)
        if request.stream:
            return httpx2.Response(
                200,
                headers={"content-type": "text/event-stream"},
                content=b"".join(openai_chat.stream_events(request, completion)),
            )
        return httpx2.Response(200, json=openai_chat.response_body(request, completion))

    return openai.OpenAI(
        base_url="http://test/v1",
        api_key="x",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handle)),
    )


def function_calls(message: ChatCompletionMessage) -> list[tuple[str, str, str, str]]:
    """(id, type, name, arguments) of each tool call, all of them function calls."""
    calls = message.tool_calls or []
    assert all(isinstance(call, ChatCompletionMessageFunctionToolCall) for call in calls)
    return [
        (c.id, c.type, c.function.name, c.function.arguments)
        for c in calls
        if isinstance(c, ChatCompletionMessageFunctionToolCall)
    ]


def answering(
    *messages: Message, finish: FinishReason = "stop"
) -> Callable[[ChatRequest], Completion]:
    """An engine that answers every request with `messages` (one per choice, cycled over n)."""
    return lambda request: make_completion(
        *(make_choice(messages[i % len(messages)], finish, i) for i in range(request.n))
    )


# -- answers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MESSAGES)
@pytest.mark.parametrize("logprobs", [False, True])
def test_every_body_passes_the_sdks_strict_validation(name: str, logprobs: bool) -> None:
    message = MESSAGES[name]
    request = parse(logprobs=logprobs, return_token_ids=True)
    body = openai_chat.response_body(request, make_completion(make_choice(message)))
    parsed = ChatCompletion.model_validate(body, strict=True)
    answer = parsed.choices[0]
    assert answer.message.content == (
        None if message.tool_calls and not message.content else message.content
    )
    assert answer.finish_reason == ("tool_calls" if message.tool_calls else "stop")
    assert [
        (i, name, json.loads(arguments)) for i, _, name, arguments in function_calls(answer.message)
    ] == [(c.id, c.name, c.arguments) for c in message.tool_calls]
    assert body["choices"][0]["message"].get("reasoning_content") == message.reasoning_content
    assert "tool_calls" in body["choices"][0]["message"] or not message.tool_calls
    assert body["prompt_token_ids"] == [1, 2, 3, 4] and body["choices"][0]["token_ids"] == [
        100,
        101,
        102,
        103,
        104,
    ]
    assert parsed.usage is not None and (
        parsed.usage.prompt_tokens,
        parsed.usage.completion_tokens,
        parsed.usage.total_tokens,
    ) == (4, 5, 9)
    if logprobs:
        assert answer.logprobs is not None and answer.logprobs.content is not None
        assert [(t.token, t.logprob, t.bytes) for t in answer.logprobs.content][:2] == [
            ("t0é", -0.25, list("t0é".encode())),
            ("t1é", -0.5, list("t1é".encode())),
        ]
    else:
        assert answer.logprobs is None


def test_a_plain_body_has_only_openais_fields() -> None:
    body = openai_chat.response_body(parse(), make_completion(make_choice(MESSAGES["text"])))
    assert body == {
        "id": "chatcmpl-cmpl0123",
        "object": "chat.completion",
        "created": 1_700_000_000,
        "model": "test-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello!"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9},
    }


def test_a_length_cut_answer_ends_with_length() -> None:
    body = openai_chat.response_body(
        parse(), make_completion(make_choice(MESSAGES["long text"], "length"))
    )
    assert body["choices"][0]["finish_reason"] == "length"


def test_the_sdk_makes_a_plain_call() -> None:
    client = sdk_client(answering(MESSAGES["reasoning"]))
    answer = client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "6*7?"}]
    )
    assert answer.choices[0].message.content == "42"
    assert answer.choices[0].message.model_extra == {"reasoning_content": "Six times seven."}


# -- streams -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MESSAGES)
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_every_chunk_passes_strict_validation_and_ends_the_stream_as_openai_does(
    name: str, finish: FinishReason
) -> None:
    request = parse(stream=True, stream_options={"include_usage": True}, logprobs=True)
    payloads = chunk_payloads(frames(request, make_completion(make_choice(MESSAGES[name], finish))))
    chunks = [ChatCompletionChunk.model_validate(p, strict=True) for p in payloads]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[:-1]].count(None) == len(chunks) - 2
    assert chunks[-2].choices[0].finish_reason == (
        "tool_calls" if MESSAGES[name].tool_calls else finish
    )
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage is not None
        and chunks[-1].usage.total_tokens == 9
    )
    assert all(p["usage"] is None for p in payloads[:-1])  # OpenAI's null until the usage chunk
    assert {p["id"] for p in payloads} == {"chatcmpl-cmpl0123"}


def test_a_stream_without_usage_options_has_no_usage() -> None:
    payloads = chunk_payloads(
        frames(parse(stream=True), make_completion(make_choice(MESSAGES["text"])))
    )
    assert all("usage" not in p for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("name", MESSAGES)
def test_the_sdks_stream_helper_reassembles_the_body(name: str) -> None:
    """`client.chat.completions.stream` accumulates the chunks into the very message the
    non-streaming answer carries."""
    message = MESSAGES[name]
    client = sdk_client(answering(message))
    with client.chat.completions.stream(
        model="test-model",
        messages=[{"role": "user", "content": "Hi"}],
        logprobs=True,
        extra_body={"return_token_ids": True},
    ) as stream:
        streamed = stream.get_final_completion()
    body = openai_chat.response_body(parse(logprobs=True), make_completion(make_choice(message)))
    expected = ChatCompletion.model_validate(body).choices[0]
    got = streamed.choices[0]
    assert got.message.content == expected.message.content
    assert (got.message.model_extra or {}).get("reasoning_content") == message.reasoning_content
    assert function_calls(got.message) == function_calls(expected.message)
    assert got.finish_reason == expected.finish_reason
    assert got.logprobs == expected.logprobs


def test_plain_streamed_chunks_add_up_to_each_choice() -> None:
    client = sdk_client(answering(MESSAGES["text and tool calls"], MESSAGES["long text"]))
    stream = client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {0: "", 1: ""}
    calls: dict[tuple[int, int], dict[str, str]] = {}
    finishes: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(
                    (choice.index, call.index), {"id": "", "name": "", "arguments": ""}
                )
                entry["id"] += call.id or ""
                entry["name"] += call.function.name or "" if call.function else ""
                entry["arguments"] += call.function.arguments or "" if call.function else ""
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert texts == {0: "Let me look.", 1: LONG}
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("call_a", "search", {"q": "plait", "deep": {"k": [1, 2.5, None, True]}}),
        ("call_b", "lookup", {}),
    ]
    assert finishes == {0: "tool_calls", 1: "stop"}
    assert usage is not None and usage.completion_tokens == 10


def test_token_ids_travel_in_the_stream() -> None:
    request = parse(stream=True, return_token_ids=True)
    payloads = chunk_payloads(frames(request, make_completion(make_choice(MESSAGES["text"]))))
    assert payloads[0]["prompt_token_ids"] == [1, 2, 3, 4]
    assert payloads[-1]["choices"][0]["token_ids"] == [100, 101, 102, 103, 104]


# -- requests ----------------------------------------------------------------------------------


def test_a_request_from_the_sdk_parses() -> None:
    seen: list[ChatRequest] = []
    client = sdk_client(answering(MESSAGES["text"]), seen)
    client.chat.completions.create(
        model="test-model",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Find"}, {"type": "text", "text": "plait"}],
                "name": "ann",
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "search", "arguments": '{"q": "plait"}'},
                    }
                ],
            },
            {
                "role": "tool",
                "tool_call_id": "call_1",
                "content": [{"type": "text", "text": "found"}],
            },
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "search",
                    "description": "Searches.",
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                    "strict": True,
                },
            }
        ],
        tool_choice={"type": "function", "function": {"name": "search"}},
        max_completion_tokens=64,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        n=2,
        stop=["END", "STOP"],
        logprobs=True,
        top_logprobs=0,
        parallel_tool_calls=False,
        user="u",
        metadata={"k": "v"},
        store=False,
        frequency_penalty=0,
        presence_penalty=0.0,
        response_format={"type": "text"},
        stream=False,
        extra_body={
            "top_k": 20,
            "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert seen == [
        ChatRequest(
            model="test-model",
            messages=[
                Message("system", "Be brief."),
                Message("user", "Find\nplait", name="ann"),
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
            tool_choice="search",
            parallel_tool_calls=False,
            temperature=0.5,
            top_p=0.9,
            top_k=20,
            seed=7,
            stop=("END", "STOP"),
            n=2,
            logprobs=True,
            extra={"include_usage": False, "return_token_ids": True},
        )
    ]


def test_defaults_and_nulls_read_as_absent() -> None:
    request = parse(
        temperature=None,
        top_p=None,
        max_tokens=None,
        tools=None,
        tool_choice=None,
        stop=None,
        n=None,
        seed=None,
        stream=None,
        stream_options=None,
        logprobs=None,
        top_logprobs=None,
    )
    assert request == ChatRequest(
        "test-model",
        [Message("user", "Hi")],
        extra={"include_usage": False, "return_token_ids": False},
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"max_tokens": 10, "max_completion_tokens": 20}, {"max_tokens": 20}),
        ({"max_tokens": 10.0}, {"max_tokens": 10}),
        ({"top_k": 0}, {"top_k": -1}),
        ({"temperature": 0}, {"temperature": 0.0}),
        ({"stop": "END"}, {"stop": ("END",)}),
        (
            {"tool_choice": "none", "tools": [{"type": "function", "function": {"name": "f"}}]},
            {"tool_choice": "none", "tools": (ToolSpec("f"),)},
        ),
    ],
)
def test_options_read_as_documented(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    request = parse(**fields)
    assert {key: getattr(request, key) for key in expected} == expected


def test_assistant_reasoning_is_read_from_either_field() -> None:
    for key in ("reasoning_content", "reasoning"):
        request = parse(
            messages=[
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A", key: "R"},
            ]
        )
        assert request.messages[1] == Message("assistant", "A", reasoning_content="R")


@pytest.mark.parametrize("name", MESSAGES)
def test_an_answer_sent_back_parses_to_the_same_message(name: str) -> None:
    """What the proxy matches a continued conversation on: the assistant message of its own
    answer, echoed back by a client, reads as the message the renderer parsed."""
    message = MESSAGES[name]
    body = openai_chat.response_body(parse(), make_completion(make_choice(message)))
    echoed = body["choices"][0]["message"]
    results = [
        {"role": "tool", "tool_call_id": call.id, "content": "ok"} for call in message.tool_calls
    ]
    request = parse(messages=[{"role": "user", "content": "Hi"}, echoed, *results])
    assert request.messages[1] == message
    assert [m.name for m in request.messages[2:]] == [call.name for call in message.tool_calls]


def test_the_sdks_own_message_objects_parse_back() -> None:
    """Agents append `completion.choices[0].message` (the SDK's object) to their history."""
    client = sdk_client(answering(MESSAGES["text and tool calls"]))
    answer = client.chat.completions.create(
        model="test-model", messages=[{"role": "user", "content": "Hi"}]
    )
    seen: list[ChatRequest] = []
    sdk_client(answering(MESSAGES["text"]), seen).chat.completions.create(
        model="test-model",
        messages=[
            {"role": "user", "content": "Hi"},
            answer.choices[0].message,  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": "call_a", "content": "r1"},
            {"role": "tool", "tool_call_id": "call_b", "content": "r2"},
        ],
    )
    assert seen[0].messages[1] == MESSAGES["text and tool calls"]


# -- refusals ----------------------------------------------------------------------------------

USER = {"role": "user", "content": "Hi"}
SEARCH = {"type": "function", "function": {"name": "search"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"messages": [USER]}, "model"),
        ({"model": 7, "messages": [USER]}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": {"role": "user"}}, "messages"),
        ({"model": "m", "messages": ["hi"]}, "messages[0]"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        (
            {"model": "m", "messages": [{"role": "function", "name": "f", "content": "x"}]},
            "messages[0].role",
        ),
        ({"model": "m", "messages": [USER, {"role": "user"}]}, "messages[1].content"),
        ({"model": "m", "messages": [USER, {"role": "user", "content": 5}]}, "messages[1].content"),
        (
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:"}}],
                    }
                ],
            },
            "messages[0].content[0].type",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "\ud800"}]},
            "messages[0].content",
        ),
        (
            {"model": "m", "messages": [USER, {"role": "tool", "content": "r"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "model": "m",
                "messages": [USER, {"role": "tool", "tool_call_id": "nowhere", "content": "r"}],
            },
            "messages[1].tool_call_id",
        ),
        (
            {
                "model": "m",
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ],
                    },
                ],
            },
            "messages[1].tool_calls[0].id",
        ),
        (
            {
                "model": "m",
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "[1]"},
                            }
                        ],
                    },
                ],
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "model": "m",
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{oops"},
                            }
                        ],
                    },
                ],
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "model": "m",
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": {"a": 1}},
                            }
                        ],
                    },
                ],
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "model": "m",
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "custom", "custom": {"name": "f"}}],
                    },
                ],
            },
            "messages[1].tool_calls[0].type",
        ),
        (
            {"model": "m", "messages": [USER, {"role": "assistant", "tool_calls": {"id": "c"}}]},
            "messages[1].tool_calls",
        ),
        (
            {
                "model": "m",
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "content": None,
                        "function_call": {"name": "f", "arguments": "{}"},
                    },
                ],
            },
            "messages[1].function_call",
        ),
        (
            {
                "model": "m",
                "messages": [USER],
                "tools": [{"type": "custom", "custom": {"name": "f"}}],
            },
            "tools[0].type",
        ),
        ({"model": "m", "messages": [USER], "tools": [{"type": "function"}]}, "tools[0].function"),
        (
            {
                "model": "m",
                "messages": [USER],
                "tools": [{"type": "function", "function": {"name": 3}}],
            },
            "tools[0].function.name",
        ),
        ({"model": "m", "messages": [USER], "tools": [SEARCH, SEARCH]}, "tools[1].function.name"),
        (
            {
                "model": "m",
                "messages": [USER],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}],
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "model": "m",
                "messages": [USER],
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 42}}}
                ],
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "model": "m",
                "messages": [USER],
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"properties": {"x": 1}}},
                    }
                ],
            },
            "tools[0].function.parameters",
        ),
        (
            {"model": "m", "messages": [USER], "tools": [SEARCH], "tool_choice": "any"},
            "tool_choice",
        ),
        ({"model": "m", "messages": [USER], "tool_choice": "required"}, "tool_choice"),
        (
            {
                "model": "m",
                "messages": [USER],
                "tools": [SEARCH],
                "tool_choice": {"type": "function", "function": {"name": "other"}},
            },
            "tool_choice.function.name",
        ),
        (
            {
                "model": "m",
                "messages": [USER],
                "tools": [SEARCH],
                "tool_choice": {"type": "function"},
            },
            "tool_choice.function",
        ),
        ({"model": "m", "messages": [USER], "n": 0}, "n"),
        ({"model": "m", "messages": [USER], "n": 17}, "n"),
        ({"model": "m", "messages": [USER], "n": True}, "n"),
        ({"model": "m", "messages": [USER], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [USER], "max_tokens": 10**40}, "max_tokens"),
        ({"model": "m", "messages": [USER], "max_completion_tokens": 1.5}, "max_completion_tokens"),
        ({"model": "m", "messages": [USER], "temperature": 2.5}, "temperature"),
        ({"model": "m", "messages": [USER], "temperature": float("nan")}, "temperature"),
        ({"model": "m", "messages": [USER], "temperature": "hot"}, "temperature"),
        ({"model": "m", "messages": [USER], "top_p": 0}, "top_p"),
        ({"model": "m", "messages": [USER], "top_p": 10**400}, "top_p"),
        ({"model": "m", "messages": [USER], "top_k": -2}, "top_k"),
        ({"model": "m", "messages": [USER], "seed": 2**64}, "seed"),
        ({"model": "m", "messages": [USER], "stop": [1]}, "stop"),
        ({"model": "m", "messages": [USER], "stop": ["s"] * 17}, "stop"),
        ({"model": "m", "messages": [USER], "stream": "yes"}, "stream"),
        (
            {"model": "m", "messages": [USER], "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
        ),
        ({"model": "m", "messages": [USER], "stream_options": []}, "stream_options"),
        ({"model": "m", "messages": [USER], "logprobs": "true"}, "logprobs"),
        ({"model": "m", "messages": [USER], "top_logprobs": 5}, "top_logprobs"),
        ({"model": "m", "messages": [USER], "frequency_penalty": 0.5}, "frequency_penalty"),
        ({"model": "m", "messages": [USER], "presence_penalty": -1}, "presence_penalty"),
        (
            {"model": "m", "messages": [USER], "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"model": "m", "messages": [USER], "logit_bias": {"50256": -100}}, "logit_bias"),
        ({"model": "m", "messages": [USER], "metadata": {"k": 1}}, "metadata.k"),
        ({"model": "m", "messages": [USER], "user": ["u"]}, "user"),
        ({"model": "m", "messages": [USER], "return_token_ids": "yes"}, "return_token_ids"),
    ],
)
def test_a_malformed_request_is_refused_naming_the_field(body: Any, param: str | None) -> None:
    with pytest.raises(RequestError) as refused:
        openai_chat.parse_request(body)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert refused.value.message


def test_refusals_say_what_to_send() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"top_logprobs": 3}, "only the sampled token's logprob"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
        (
            {
                "messages": [
                    USER,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[]"}}],
                    },
                ]
            },
            "JSON object",
        ),
    ]
    for fields, phrase in cases:
        with pytest.raises(RequestError, match=phrase):
            parse(**fields)


def test_the_sdk_raises_the_refusal_with_its_param() -> None:
    client = sdk_client(answering(MESSAGES["text"]))
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="test-model",
            messages=[{"role": "user", "content": "Hi"}],
            top_logprobs=2,
            logprobs=True,
        )
    assert (refused.value.param, refused.value.type, refused.value.code) == (
        "top_logprobs",
        "invalid_request_error",
        None,
    )


def test_error_kinds_that_are_not_types_become_codes() -> None:
    error = RequestError("too long", param="messages", kind="context_length_exceeded")
    assert openai_chat.error_body(error) == {
        "error": {
            "message": "too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    assert (
        openai_chat.error_body(RequestError("down", status=502, kind="api_error"))["error"]["type"]
        == "api_error"
    )


# -- fuzzing -----------------------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**62, max_value=2**80)
    | st.floats()
    | st.text(max_size=8)
    | st.sampled_from(["\ud800", "user", "function", "text", "{}", ""]),
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
                    "id",
                    "function",
                    "arguments",
                    "tool_calls",
                    "tool_call_id",
                    "parameters",
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
    "messages",
    "tools",
    "tool_choice",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "frequency_penalty",
    "response_format",
    "metadata",
    "user",
    "return_token_ids",
    "logit_bias",
]


def _parses_or_refuses(body: Any) -> None:
    try:
        request = openai_chat.parse_request(body)
    except RequestError as error:
        assert error.status == 400 and error.message
        return
    completion = make_completion(
        *(make_choice(MESSAGES["text and tool calls"], index=i) for i in range(request.n))
    )
    ChatCompletion.model_validate(openai_chat.response_body(request, completion), strict=True)
    assert chunk_payloads(frames(request, completion))


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
    body = {
        "model": "m",
        "messages": [
            USER,
            openai_chat.response_body(parse(), make_completion(make_choice(message)))["choices"][0][
                "message"
            ],
        ],
        **fields,
    }
    _parses_or_refuses(body)


def test_the_chunk_model_rejects_what_openai_would_not_send() -> None:
    """Guards the strict checks above: they do fail on a malformed chunk."""
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionChunk.model_validate(
            {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [{"index": 0, "delta": {"role": "bot"}}],
            },
            strict=True,
        )
