"""The official openai and anthropic SDKs, unmodified (only a base URL and key), against the proxy
served over HTTP in front of the reference engine: Chat Completions, Responses and Messages,
streaming and not, a tool round trip on each, and what the store recorded of it — the ids the
engine sampled, one training sequence for the whole tool session (keep-reasoning Qwen3)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from plait.plugins import get_registry
from plait.trajectory import merge_turns
from plait_proxy.app import ProxyApp, ServeOptions
from plait_proxy.proxy import Proxy
from plait_proxy.store import ProxySession, RolloutStore

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("plait_qwen", reason="needs the Qwen renderers (plait-qwen)")

SYSTEM = "You are terse."
QUESTION = "What is 7*6?"
PARAMETERS = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
EXPECTED_CALL = ("calculator", {"expression": "7*6"})
GREEDY = {"temperature": 0}  # anthropic's SDK has no temperature argument (its API does)


def serve(model: Any, scenario: Callable[[str, RolloutStore], Awaitable[Any]], **options: Any) -> Any:
    """Run `scenario(base_url, store)` against a proxy for `model` served on a free port."""
    registry = get_registry()

    async def go() -> Any:
        engine = registry.get("inference_engine", "torch").load()(model, options=None, seed=0)
        renderer = registry.get("renderer", "qwen3_keep_reasoning").load()(model, options=None)
        store = RolloutStore(**options)
        app = ProxyApp(Proxy(engine, renderer, "tool-model"), store, ServeOptions(port=0))
        try:
            async with app.serving() as url:
                return await scenario(url, store)
        finally:
            await engine.close()

    return asyncio.run(asyncio.wait_for(go(), 300))


def check_one_sequence(session: ProxySession, script: list[int], calls: int) -> None:
    assert len(session.calls) == calls
    assert all(list(c.sequence.tokens) == script for c in session.taken_choices())  # as sampled
    assert [c.prompt_source for c in session.calls] == ["render"] + ["bridge"] * (calls - 1)
    (segment,) = merge_turns(session.turns())
    assert [t for t, sampled in zip(segment.tokens, segment.sampled, strict=True) if sampled] == script * calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_chat_completions_tool_round_trip(tool_calling_qwen3: Any, stream: bool) -> None:
    model, script = tool_calling_qwen3

    async def scenario(url: str, store: RolloutStore) -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/s/chat/v1", api_key="key") as client:
            await chat_round_trip(client, store)

    async def chat_round_trip(client: Any, store: RolloutStore) -> None:
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        tools: Any = [{"type": "function", "function": {"name": "calculator", "parameters": PARAMETERS}}]
        for _ in range(2):
            if stream:
                chunks = [c async for c in await client.chat.completions.create(
                    model="tool-model", messages=messages, tools=tools, temperature=0, stream=True)]
                (call,) = {d.id: d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if d.id}.values()
                arguments = "".join(d.function.arguments or "" for c in chunks
                                    for d in (c.choices[0].delta.tool_calls or []))
                name, call_id = call.function.name, call.id
                assert chunks[-1].choices[0].finish_reason == "tool_calls"
                messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]})
            else:
                response = await client.chat.completions.create(model="tool-model", messages=messages,
                                                                 tools=tools, temperature=0, logprobs=True)
                choice = response.choices[0]
                assert choice.finish_reason == "tool_calls" and response.usage.completion_tokens == len(script)
                assert [t.logprob for t in choice.logprobs.content] == list(
                    store.sessions["chat"].calls[-1].choices[0].sequence.logprobs)
                (tool_call,) = choice.message.tool_calls
                name, arguments, call_id = tool_call.function.name, tool_call.function.arguments, tool_call.id
                messages.append(choice.message.model_dump(exclude_none=True))
            assert (name, json.loads(arguments)) == EXPECTED_CALL
            messages.append({"role": "tool", "tool_call_id": call_id, "content": "42"})
        check_one_sequence(store.sessions["chat"], script, calls=2)
        assert [m.id for m in (await client.models.list()).data] == ["tool-model"]

    serve(model, scenario)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_responses_tool_round_trip(tool_calling_qwen3: Any, stream: bool) -> None:
    model, script = tool_calling_qwen3

    async def scenario(url: str, store: RolloutStore) -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/s/responses/v1", api_key="key") as client:
            await responses_round_trip(client, store)

    async def responses_round_trip(client: Any, store: RolloutStore) -> None:
        items: list[Any] = [{"role": "user", "content": QUESTION}]
        tools: Any = [{"type": "function", "name": "calculator", "parameters": PARAMETERS, "strict": False}]
        for _ in range(2):
            if stream:
                async with client.responses.stream(model="tool-model", instructions=SYSTEM, input=items,
                                                   tools=tools, temperature=0) as events:
                    response = await events.get_final_response()
            else:
                response = await client.responses.create(model="tool-model", instructions=SYSTEM, input=items,
                                                         tools=tools, temperature=0)
            calls = [item for item in response.output if item.type == "function_call"]
            assert [(c.name, json.loads(c.arguments)) for c in calls] == [EXPECTED_CALL]
            items += [item.model_dump(exclude_none=True) for item in response.output]
            items.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "42"})
        check_one_sequence(store.sessions["responses"], script, calls=2)

    serve(model, scenario)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_anthropic_messages_tool_round_trip(tool_calling_qwen3: Any, stream: bool) -> None:
    model, script = tool_calling_qwen3

    async def scenario(url: str, store: RolloutStore) -> None:
        async with anthropic.AsyncAnthropic(base_url=f"{url}/s/messages", api_key="key") as client:
            await messages_round_trip(client, store)

    async def messages_round_trip(client: Any, store: RolloutStore) -> None:
        messages: list[Any] = [{"role": "user", "content": QUESTION}]
        tools: Any = [{"name": "calculator", "description": "Evaluate arithmetic.", "input_schema": PARAMETERS}]
        for _ in range(2):
            if stream:
                async with client.messages.stream(model="tool-model", max_tokens=64, system=SYSTEM,
                                                  messages=messages, tools=tools, extra_body=GREEDY) as events:
                    message = await events.get_final_message()
            else:
                message = await client.messages.create(model="tool-model", max_tokens=64, system=SYSTEM,
                                                       messages=messages, tools=tools, extra_body=GREEDY)
            assert message.stop_reason == "tool_use"
            uses = [block for block in message.content if block.type == "tool_use"]
            assert [(u.name, u.input) for u in uses] == [EXPECTED_CALL]
            assert [b.thinking for b in message.content if b.type == "thinking"] == ["add them"]
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": uses[0].id, "content": "42"}]})
        check_one_sequence(store.sessions["messages"], script, calls=2)

    serve(model, scenario)


def test_sessions_come_from_the_path_the_header_or_the_api_key(tiny_qwen3: Any) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.post("/s/by-path/v1/chat/completions", json=body)).status_code == 200
            assert (await http.post("/v1/chat/completions", json=body,
                                    headers={"x-plait-session": "by-header"})).status_code == 200
            assert (await http.post("/v1/messages", json=body, headers={"x-api-key": "by-key"})).status_code == 200
            missing = await http.post("/v1/chat/completions", json=body)
            assert missing.status_code == 400 and "session" in missing.json()["error"]["message"]
            assert sorted(store.sessions) == ["by-header", "by-key", "by-path"]
            finished = (await http.post("/sessions/by-path/finish")).json()
            assert finished["calls"][0]["choices"][0]["token_ids"] and "by-path" not in store.sessions

    serve(tiny_qwen3, scenario)


def test_an_unknown_session_is_a_404_when_sessions_must_be_opened(tiny_qwen3: Any) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/s/nobody/v1", api_key="key", max_retries=0) as client:
            with pytest.raises(openai.NotFoundError, match="open it first"):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert not store.sessions

    serve(tiny_qwen3, scenario, auto_create=False)


def test_a_client_that_disconnects_cancels_its_sampling_and_records_nothing(tiny_qwen3: Any) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        body = {"model": "m", "max_tokens": 3000, "temperature": 1.0, "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(base_url=url, timeout=1.0) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/s/gone/v1/chat/completions", json=body)
        for _ in range(100):
            if store.sessions["gone"].in_flight == 0:
                break
            await asyncio.sleep(0.05)
        assert store.sessions["gone"].in_flight == 0 and store.sessions["gone"].calls == []

    serve(tiny_qwen3, scenario)


@pytest.mark.slow  # a new process loads plait, torch and the model: a minute on a loaded machine
def test_plait_serve_proxy_serves_a_run_configs_model_and_stores_finished_sessions(
        tiny_qwen3: Any, tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys
    import time

    config = tmp_path / "proxy.toml"
    config.write_text(f'[model]\nname = "{tiny_qwen3.path}"\n[inference]\nengine = "torch"\n'
                      '[renderer]\nname = "qwen3_keep_reasoning"\n')
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "plait.cli", "serve", "proxy", str(config), "--port", str(port),
                               "--store", str(tmp_path / "store")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read().decode() if server.stdout else ""
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "plait serve proxy did not come up in 120 s"
                time.sleep(0.5)
        with openai.OpenAI(base_url=f"{url}/s/cli/v1", api_key="key") as client:
            answer = client.chat.completions.create(model="any", max_tokens=3, messages=[{"role": "user", "content": "hi"}],
                                                    extra_body={"return_token_ids": True})
        assert answer.model_extra and len(answer.choices[0].model_extra["token_ids"]) == 3
        record = httpx.post(f"{url}/sessions/cli/finish").json()
        stored = json.loads((tmp_path / "store" / "sessions.jsonl").read_text())
        assert stored == record and stored["calls"][0]["choices"][0]["token_ids"] == answer.choices[0].model_extra["token_ids"]
    finally:
        server.terminate()
        server.wait(30)
