"""tool_choice "required" and a named tool constrain decoding to calls of the offered tools:
through the official SDKs, even the random tiny-qwen3 answers with calls whose arguments
validate against the tools' schemas, and the recorded token ids are exactly what it sampled."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from plait_proxy.store import RolloutStore
from plait_proxy.testing import serve_on_torch
from plait_testing.tool_calls import TOOLS

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("plait_qwen", reason="needs the Qwen renderers (plait-qwen)")

SCHEMAS = {tool.name: tool.input_schema for tool in TOOLS}
OPENAI_TOOLS: Any = [
    {"type": "function", "function": {"name": t.name, "parameters": t.input_schema}} for t in TOOLS
]
QUESTION = [{"role": "user", "content": "What will the weather be in Oslo tomorrow?"}]


def check_recorded(store: RolloutStore, session: str, received: list[tuple[str, dict]]) -> None:
    """The session holds the sampled ids, and they decode to the calls the client received."""
    recorded = store.get(session)
    choices = recorded.taken_choices()
    assert [(c.name, c.arguments) for ch in choices for c in ch.message.tool_calls] == received
    for choice in choices:
        assert choice.sequence.tokens and choice.termination.is_clean


@pytest.mark.parametrize(
    "parallel", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["one", "parallel"]
)
def test_required_yields_valid_calls_through_the_openai_sdk(
    tiny_qwen3: Any, parallel: bool
) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/s/required/v1", api_key="k") as client:
            received = []
            for seed in range(3):
                reply = await client.chat.completions.create(
                    model="tool-model",
                    messages=QUESTION,
                    tools=OPENAI_TOOLS,
                    tool_choice="required",
                    parallel_tool_calls=parallel,
                    seed=seed,
                    max_tokens=400,
                )
                choice = reply.choices[0]
                assert choice.finish_reason == "tool_calls", choice
                calls = choice.message.tool_calls or []
                assert calls and (parallel or len(calls) == 1)
                for call in calls:
                    arguments = json.loads(call.function.arguments)
                    jsonschema.validate(arguments, SCHEMAS[call.function.name])
                    received.append((call.function.name, arguments))
        check_recorded(store, "required", received)

    serve_on_torch(tiny_qwen3, scenario)


@pytest.mark.slow  # 7 s; plait-torch's test_grammar covers a named tool in make check
def test_a_named_tool_is_the_one_called_through_the_openai_sdk(tiny_qwen3: Any) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/s/named/v1", api_key="k") as client:
            for seed in range(3):
                reply = await client.chat.completions.create(
                    model="tool-model",
                    messages=QUESTION,
                    tools=OPENAI_TOOLS,
                    tool_choice={"type": "function", "function": {"name": "search"}},
                    seed=seed,
                    max_tokens=400,
                )
                calls = reply.choices[0].message.tool_calls or []
                assert calls and {c.function.name for c in calls} == {"search"}
                for call in calls:
                    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["search"])
            response = await client.responses.create(
                model="tool-model",
                input="Find my notes on Oslo.",
                tools=[
                    {"type": "function", "name": t.name, "parameters": t.input_schema}
                    for t in TOOLS
                ],
                tool_choice={"type": "function", "name": "get_weather"},
                max_output_tokens=400,
            )
            calls = [item for item in response.output if item.type == "function_call"]
            assert calls and {c.name for c in calls} == {"get_weather"}
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])

    serve_on_torch(tiny_qwen3, scenario)


def test_anthropic_any_and_tool_choices_yield_tool_use_blocks(tiny_qwen3: Any) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        tools: Any = [{"name": t.name, "input_schema": t.input_schema} for t in TOOLS]
        async with anthropic.AsyncAnthropic(base_url=f"{url}/s/anthropic", api_key="k") as client:
            for choice in (
                {"type": "any", "disable_parallel_tool_use": True},
                {"type": "tool", "name": "search"},
            ):
                reply = await client.messages.create(
                    model="tool-model",
                    max_tokens=400,
                    messages=QUESTION,
                    tools=tools,
                    tool_choice=choice,
                )
                uses = [block for block in reply.content if block.type == "tool_use"]
                assert reply.stop_reason == "tool_use" and uses
                if choice["type"] == "tool":
                    assert {u.name for u in uses} == {"search"}
                else:
                    assert len(uses) == 1
                for use in uses:
                    jsonschema.validate(use.input, SCHEMAS[use.name])

    serve_on_torch(tiny_qwen3, scenario)


@pytest.mark.slow  # with the slow tests (make check < 5 min)
def test_thinking_qwen3_5_closes_its_open_reasoning_block_first(tiny_qwen3: Any) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/s/think/v1", api_key="k") as client:
            reply = await client.chat.completions.create(
                model="tool-model",
                messages=QUESTION,
                tools=OPENAI_TOOLS,
                tool_choice="required",
                parallel_tool_calls=False,
                seed=1,
                max_tokens=400,
            )
        (call,) = reply.choices[0].message.tool_calls or []
        assert call.function.name in SCHEMAS

    serve_on_torch(tiny_qwen3, scenario, renderer="qwen3_5")


def test_a_renderer_without_a_tool_call_grammar_is_a_400_naming_it(tiny_qwen3: Any) -> None:
    from plait_hf.chat_template import ChatTemplateOptions

    async def scenario(url: str, store: RolloutStore) -> None:
        body = {
            "model": "tool-model",
            "messages": QUESTION,
            "tools": OPENAI_TOOLS,
            "tool_choice": "required",
        }
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            response = await http.post("/s/none/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "tool_choice"
        assert "ChatTemplateRenderer" in error["message"]

    serve_on_torch(
        tiny_qwen3,
        scenario,
        renderer="chat_template",
        renderer_options=ChatTemplateOptions(tool_call_format="none"),
    )
