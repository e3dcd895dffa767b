"""The proxy answers as the APIs it copies, driven by the official openai and anthropic SDKs (raw
HTTP where no SDK call reaches) in front of plait-torch on the random tiny-qwen3: an unknown model
is a 404 in each API's shape (and `--served-model-name` adds names), a max_tokens past the
context is a 400 naming it, refused and cancelled requests leave no session, `--api-key` guards
every route and its errors name the fixes of that mode, tool schemas and tool-result ids are
checked, and the openai SDK harness carries on from a turn cut at the token limit."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import pytest

from plait_proxy.app import ProxyApp, ServeOptions
from plait_proxy.proxy import Limits
from plait_proxy.store import RolloutStore
from plait_proxy.testing import MODEL, serve_on_torch

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("plait_qwen", reason="needs the Qwen renderers (plait-qwen)")

HARNESSES = Path(__file__).resolve().parents[3] / "examples" / "harnesses"
HI = [{"role": "user", "content": "hi"}]
GARBAGE_SCHEMA = {"type": 42, "properties": ["not", "a", "schema"]}


def clients(url: str, session: str, **options: Any) -> tuple[Any, Any]:
    """The two SDKs' async clients on a session's path, without retries."""
    return (
        openai.AsyncOpenAI(
            base_url=f"{url}/s/{session}/v1", api_key="key", max_retries=0, **options
        ),
        anthropic.AsyncAnthropic(
            base_url=f"{url}/s/{session}", api_key="key", max_retries=0, **options
        ),
    )


def test_an_unknown_model_is_a_404_in_each_apis_shape_and_served_names_are_aliases(
    tiny_qwen3: Any,
) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        oa, an = clients(url, "models")
        with pytest.raises(openai.NotFoundError) as chat:
            await oa.chat.completions.create(model="gpt-nope", messages=HI, max_tokens=2)
        with pytest.raises(openai.NotFoundError) as responses:
            await oa.responses.create(model="gpt-nope", input="hi", max_output_tokens=2)
        for refused in (chat, responses):
            error = refused.value.response.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model"
            assert error["type"] == "invalid_request_error" and "gpt-nope" in error["message"]
        with pytest.raises(anthropic.NotFoundError) as messages:
            await an.messages.create(model="claude-nope", messages=HI, max_tokens=2)
        body = messages.value.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
        assert "claude-nope" in body["error"]["message"]
        assert not store.sessions  # refused before any session was opened

        for name in (MODEL, "alias"):
            answer = await oa.chat.completions.create(model=name, messages=HI, max_tokens=2)
            assert answer.model == name
        reply = await an.messages.create(model="alias", messages=HI, max_tokens=2)
        assert reply.model == "alias"

        assert [m.id async for m in oa.models.list()] == [MODEL, "alias"]
        assert [m.id async for m in an.models.list()] == [MODEL, "alias"]
        assert (await oa.models.retrieve("alias")).id == "alias"
        with pytest.raises(openai.NotFoundError) as card:
            await oa.models.retrieve("gpt-nope")
        assert card.value.response.json()["error"]["code"] == "model_not_found"
        with pytest.raises(anthropic.NotFoundError) as anthropic_card:
            await an.models.retrieve("claude-nope")
        assert anthropic_card.value.response.json()["error"]["type"] == "not_found_error"

    serve_on_torch(tiny_qwen3, scenario, serve_options={"served_model_names": ["alias"]})


def test_served_model_names_come_from_the_flag_or_else_the_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import click
    from click.testing import CliRunner

    import plait.api
    from plait_proxy import app, plugin, proxy

    served: list[ServeOptions] = []

    class Started(Exception):
        pass

    class RecordedApp:
        def __init__(self, proxy: Any, store: Any, options: ServeOptions) -> None:
            served.append(options)
            raise Started

    monkeypatch.setattr(proxy, "build_proxy", lambda config: None)
    monkeypatch.setattr(app, "ProxyApp", RecordedApp)
    monkeypatch.setattr(plait.api, "configure_logging", lambda level: None)
    group = click.Group()
    plugin.plait_register_commands(group)
    config = ["-s", 'serve.proxy.served_model_names=["from-config"]']
    for flags in (config, [*config, "--served-model-name", "a", "--served-model-name", "b"]):
        result = CliRunner().invoke(group, ["serve", "proxy", *flags])
        assert isinstance(result.exception, Started), result.output
    assert [options.served_model_names for options in served] == [("from-config",), ("a", "b")]


def test_max_tokens_past_the_context_is_a_400_naming_the_limit(tiny_qwen3: Any) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        oa, an = clients(url, "limits")
        refusals = []
        for key in ("max_tokens", "max_completion_tokens"):
            for asked in (10**9, 60):  # too many alone; too many beside the prompt
                with pytest.raises(openai.BadRequestError) as chat:
                    await oa.chat.completions.create(model=MODEL, messages=HI, **{key: asked})
                refusals.append(chat.value.response.json()["error"])
        with pytest.raises(openai.BadRequestError) as responses:
            await oa.responses.create(model=MODEL, input="hi", max_output_tokens=10**9)
        refusals.append(responses.value.response.json()["error"])
        for error in refusals:
            assert error["code"] == "context_length_exceeded", error
            assert "maximum context length is 64 tokens" in error["message"], error
        # the SDK sends a max_tokens this large only to a stream (it would take too long whole)
        for asked, stream in ((10**9, True), (60, False)):
            with pytest.raises(anthropic.BadRequestError) as messages:
                await an.messages.create(model=MODEL, messages=HI, max_tokens=asked, stream=stream)
            body = messages.value.response.json()
            assert body["error"]["type"] == "invalid_request_error"
            assert "maximum context length is 64 tokens" in body["error"]["message"]
        assert not store.sessions  # and no session stays behind (see below)

        fits = await oa.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
        assert fits.usage and fits.usage.completion_tokens <= 4
        unlimited = await oa.chat.completions.create(model=MODEL, messages=HI)
        assert unlimited.usage and unlimited.usage.total_tokens <= 64  # what the context leaves

    serve_on_torch(tiny_qwen3, scenario, limits=Limits(max_context_tokens=64))


def test_refused_and_cancelled_requests_leave_no_session(tiny_qwen3: Any) -> None:
    async def cancel(url: str, index: int) -> None:
        """A stream its client gives up on before the answer is ready (1500 tokens)."""
        oa, an = clients(url, f"cancelled-{index}", timeout=0.2)
        with pytest.raises((openai.APITimeoutError, anthropic.APITimeoutError)):
            if index % 2:
                await an.messages.create(model=MODEL, messages=HI, max_tokens=1500, stream=True)
            else:
                await oa.chat.completions.create(
                    model=MODEL, messages=HI, max_tokens=1500, stream=True
                )

    async def refuse(url: str, session: str, index: int) -> None:
        """A request refused for its context length: a prompt past the 2048 tokens served."""
        oa, an = clients(url, session)
        long = [{"role": "user", "content": "hi " * 3000}]
        with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)):
            if index % 2:
                await an.messages.create(model=MODEL, messages=long, max_tokens=2)
            else:
                await oa.chat.completions.create(model=MODEL, messages=long, max_tokens=2)

    async def scenario(url: str, store: RolloutStore) -> None:
        oa, _ = clients(url, "recorded")
        await oa.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        async with httpx.AsyncClient(base_url=url) as http:
            opened = (await http.post("/sessions")).json()["session"]
            await asyncio.gather(*(cancel(url, i) for i in range(50)))
            await asyncio.gather(*(refuse(url, f"refused-{i}", i) for i in range(10)))
            for kept in ("recorded", opened):  # refusals in sessions that are kept
                await refuse(url, kept, 1)
            for _ in range(200):  # the server notices the disconnects in its own time
                listed = (await http.get("/sessions")).json()["sessions"]
                if len(listed) == 2 and not any(s["in_flight"] for s in listed):
                    break
                await asyncio.sleep(0.05)
        assert {s["session"]: s["calls"] for s in listed} == {"recorded": 1, opened: 0}

    serve_on_torch(tiny_qwen3, scenario, limits=Limits(max_context_tokens=2048))


def test_an_api_key_guards_every_route_and_errors_name_the_fixes_of_that_mode(
    tiny_qwen3: Any,
) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        plain = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0)
        with pytest.raises(openai.BadRequestError) as no_session:
            await plain.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        message = no_session.value.response.json()["error"]["message"]
        assert "X-Plait-Session" in message and "/s/<id>/v1" in message
        assert "API key" not in message  # the key authenticates in this mode
        named = openai.AsyncOpenAI(
            base_url=f"{url}/v1",
            api_key="secret",
            max_retries=0,
            default_headers={"x-plait-session": "by-header"},
        )
        await named.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert [m.id async for m in named.models.list()] == [MODEL]

        wrong_openai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as openai_refusal:
            await wrong_openai.models.list()
        assert openai_refusal.value.response.json()["error"]["type"] == "authentication_error"
        wrong_anthropic = anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0)
        for call in (
            wrong_anthropic.models.list(),
            wrong_anthropic.messages.create(model=MODEL, messages=HI, max_tokens=2),
        ):
            with pytest.raises(anthropic.AuthenticationError) as anthropic_refusal:
                await call
            body = anthropic_refusal.value.response.json()
            assert body["type"] == "error" and body["error"]["type"] == "authentication_error"

        routes = ProxyApp(None, RolloutStore()).asgi.routes  # the served app's, by construction
        async with httpx.AsyncClient(base_url=url) as http:
            for route in routes:
                path = route.path.replace("{session}", "by-header").replace("{model:path}", MODEL)
                for method in route.methods - {"HEAD"}:
                    refused = await http.request(method, path, json={})
                    assert refused.status_code == 401, (method, path, refused.text)
        assert len(routes) > 10 and list(store.sessions) == ["by-header"]

    serve_on_torch(tiny_qwen3, scenario, serve_options={"api_key": "secret"})


def test_tool_schemas_must_be_json_schemas_and_tool_results_must_answer_a_call(
    tiny_qwen3: Any,
) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        oa, an = clients(url, "tools")
        refusals: list[tuple[Any, str]] = []

        async def refused(call: Awaitable[Any], param: str) -> None:
            with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as error:
                await call
            refusals.append((error.value.response.json(), param))

        function = {"name": "calculator", "parameters": GARBAGE_SCHEMA}
        await refused(
            oa.chat.completions.create(
                model=MODEL, messages=HI, tools=[{"type": "function", "function": function}]
            ),
            "tools[0].function.parameters",
        )
        await refused(
            oa.responses.create(
                model=MODEL, input="hi", tools=[{"type": "function", "strict": False, **function}]
            ),
            "tools[0].parameters",
        )
        await refused(
            an.messages.create(
                model=MODEL,
                messages=HI,
                max_tokens=2,
                tools=[{"name": "calculator", "input_schema": GARBAGE_SCHEMA}],
            ),
            "tools.0.input_schema",
        )
        await refused(
            oa.chat.completions.create(
                model=MODEL,
                messages=[*HI, {"role": "tool", "tool_call_id": "call_nowhere", "content": "42"}],
            ),
            "messages[1].tool_call_id",
        )
        await refused(
            oa.responses.create(
                model=MODEL,
                input=[
                    {"role": "user", "content": "hi"},
                    {"type": "function_call_output", "call_id": "call_nowhere", "output": "42"},
                ],
            ),
            "input[1].call_id",
        )
        tool_result = {"type": "tool_result", "tool_use_id": "toolu_nowhere", "content": "42"}
        await refused(
            an.messages.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [tool_result]}]
            ),
            "messages.0.content.0.tool_use_id",
        )
        for body, param in refusals:
            error = body["error"]
            if "param" in error:  # OpenAI's shape names the field
                assert error["param"] == param, error
            else:
                assert body["type"] == "error" and error["message"].startswith(param), body
        assert not store.sessions

        calculator = {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        }
        call = {"id": "call_1", "type": "function", "function": {"name": "calculator"}}
        await oa.chat.completions.create(  # a result that answers a call of the conversation
            model=MODEL,
            max_tokens=2,
            tools=[{"type": "function", "function": calculator}],
            messages=[
                *HI,
                {
                    "role": "assistant",
                    "tool_calls": [{**call, "function": {**call["function"], "arguments": "{}"}}],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "42"},
            ],
        )

    serve_on_torch(tiny_qwen3, scenario)


def test_the_openai_sdk_harness_keeps_a_streamed_turn_cut_at_the_token_limit(
    tiny_qwen3: Any,
) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        program = await asyncio.create_subprocess_exec(
            sys.executable,
            str(HARNESSES / "openai_sdk.py"),
            env={
                **os.environ,
                "PLAIT_PROMPT": "What is 17*23?",
                "PLAIT_MODEL": MODEL,
                "PLAIT_STREAM": "1",
                "OPENAI_BASE_URL": f"{url}/s/harness/v1",
                "OPENAI_API_KEY": "key",
                "PYTHONIOENCODING": "utf-8",
            },
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await program.communicate()
        assert program.returncode == 0, err.decode()[-2000:]
        [call] = store.sessions["harness"].calls
        assert call.choices[0].finish_reason == "length"
        assert out.decode().strip() == call.choices[0].message.content.strip()

    serve_on_torch(tiny_qwen3, scenario, limits=Limits(max_tokens=2))
