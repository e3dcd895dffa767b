"""A test kit: tool round trips driven through the official openai and anthropic SDKs, unmodified
(only a base URL and key), against a served proxy — two calls each on Chat Completions, Responses
and Messages, streaming or not, each answer echoed back the way the SDK hands it out, with a tool
result — then what the store recorded: the ids the engine sampled, and one training sequence for
the whole session (under a renderer with the extension property). The proxy's tests run it in
front of plait-torch and of vLLM; run it in front of a new engine or wire format the same way.
Needs the `openai` and `anthropic` SDKs (plait-proxy's test extra)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from plait.api import INFERENCE_ENGINE, RENDERER, get_registry
from plait_algorithms.datums import merge_turns
from plait_proxy.app import ProxyApp, ServeOptions
from plait_proxy.proxy import Limits, Proxy
from plait_proxy.store import ProxySession, RolloutStore

MODEL = "tool-model"
"""The model the round trips ask for: serve it under this name (or add it to
`ServeOptions.served_model_names`)."""
SYSTEM = "You are terse."
PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string"}},
    "required": ["expression"],
}
GREEDY = {"temperature": 0}  # anthropic's SDK has no temperature argument (its API does)
CALLS = 2


def serve_on_torch(
    model: Any,
    scenario: Callable[[str, RolloutStore], Awaitable[Any]],
    *,
    renderer: str = "qwen3_keep_reasoning",
    renderer_options: Any = None,
    limits: Limits | None = None,
    store_options: Mapping[str, Any] | None = None,
    serve_options: Mapping[str, Any] | None = None,
) -> Any:
    """Run `scenario(base_url, store)` against a proxy serving `model` as MODEL on a free port, in
    front of plait-torch's engine and the registered `renderer`."""
    registry = get_registry()

    async def go() -> Any:
        engine = registry.get(INFERENCE_ENGINE, "torch").load()(model, options=None, seed=0)
        render = registry.get(RENDERER, renderer).load()(model, options=renderer_options)
        store = RolloutStore(**(store_options or {}))
        proxy = Proxy(engine, render, MODEL, limits)
        app = ProxyApp(proxy, store, ServeOptions(port=0, **(serve_options or {})))
        try:
            async with app.serving() as url:
                return await scenario(url, store)
        finally:
            await engine.close()

    return asyncio.run(asyncio.wait_for(go(), 300))


@attrs.frozen
class ProgramRun:
    """What an agent program did: its exit status, what it printed, how long it took."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float

    def report(self, tail: int) -> str:
        return (
            f"exit {self.returncode}\n--- stdout\n{self.stdout[-tail:]}\n"
            f"--- stderr\n{self.stderr[-tail:]}"
        )


async def run_program(
    python: str, program: Path, env: Mapping[str, str], cwd: Path, timeout_s: float
) -> ProgramRun:
    """Run an agent program (examples/harnesses) in `python`, with this process's environment
    (less PYTHONPATH and VIRTUAL_ENV, which belong to this venv) updated by `env`; killed after
    `timeout_s`."""
    inherited = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        python,
        str(program),
        env={**inherited, **env},
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        out, err = await process.communicate()
    return ProgramRun(
        process.returncode,
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        time.monotonic() - started,
    )


@attrs.frozen
class Expected:
    """What the scripted model writes every turn."""

    script: list[int]
    call: tuple[str, dict[str, Any]]
    reasoning: str
    question: str = "What is 7*6?"


def check_one_sequence(session: ProxySession, script: list[int], calls: int) -> None:
    assert len(session.calls) == calls
    assert all(list(c.sequence.tokens) == script for c in session.taken_choices())  # as sampled
    assert [c.prompt_source for c in session.calls] == ["render"] + ["bridge"] * (calls - 1)
    (segment,) = merge_turns(session.turns())
    assert [
        t for t, sampled in zip(segment.tokens, segment.sampled, strict=True) if sampled
    ] == script * calls


async def chat(
    url: str, store: RolloutStore, session: str, expected: Expected, stream: bool
) -> None:
    import openai

    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": expected.question},
    ]
    tools: Any = [
        {"type": "function", "function": {"name": expected.call[0], "parameters": PARAMETERS}}
    ]
    async with openai.AsyncOpenAI(base_url=f"{url}/s/{session}/v1", api_key="key") as sdk:
        client: Any = sdk  # untyped: the checks read optional fields that this server always fills
        for _ in range(CALLS):
            if stream:
                chunks = [
                    c
                    async for c in await client.chat.completions.create(
                        model=MODEL,
                        messages=messages,
                        tools=tools,
                        temperature=0,
                        stream=True,
                    )
                ]
                (call,) = {
                    d.id: d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if d.id
                }.values()
                arguments = "".join(
                    d.function.arguments or ""
                    for c in chunks
                    for d in (c.choices[0].delta.tool_calls or [])
                )
                name, call_id = call.function.name, call.id
                assert chunks[-1].choices[0].finish_reason == "tool_calls"
                messages.append(
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": call_id,
                                "type": "function",
                                "function": {"name": name, "arguments": arguments},
                            }
                        ],
                    }
                )
            else:
                response = await client.chat.completions.create(
                    model=MODEL, messages=messages, tools=tools, temperature=0, logprobs=True
                )
                choice = response.choices[0]
                assert (
                    choice.finish_reason == "tool_calls"
                    and response.usage.completion_tokens == len(expected.script)
                )
                assert [t.logprob for t in choice.logprobs.content] == list(
                    store.sessions[session].calls[-1].choices[0].sequence.logprobs
                )
                (tool_call,) = choice.message.tool_calls
                name, arguments, call_id = (
                    tool_call.function.name,
                    tool_call.function.arguments,
                    tool_call.id,
                )
                messages.append(choice.message.model_dump(exclude_none=True))
            assert (name, json.loads(arguments)) == expected.call
            messages.append({"role": "tool", "tool_call_id": call_id, "content": "42"})
    check_one_sequence(store.sessions[session], expected.script, calls=CALLS)


async def responses(
    url: str, store: RolloutStore, session: str, expected: Expected, stream: bool
) -> None:
    import openai

    items: list[Any] = [{"role": "user", "content": expected.question}]
    tools: Any = [
        {"type": "function", "name": expected.call[0], "parameters": PARAMETERS, "strict": False}
    ]
    async with openai.AsyncOpenAI(base_url=f"{url}/s/{session}/v1", api_key="key") as sdk:
        client: Any = sdk  # untyped: the checks read optional fields that this server always fills
        for _ in range(CALLS):
            if stream:
                async with client.responses.stream(
                    model=MODEL, instructions=SYSTEM, input=items, tools=tools, temperature=0
                ) as events:
                    response = await events.get_final_response()
            else:
                response = await client.responses.create(
                    model=MODEL, instructions=SYSTEM, input=items, tools=tools, temperature=0
                )
            calls = [item for item in response.output if item.type == "function_call"]
            assert [(c.name, json.loads(c.arguments)) for c in calls] == [expected.call]
            items += [item.model_dump(exclude_none=True) for item in response.output]
            items.append(
                {"type": "function_call_output", "call_id": calls[0].call_id, "output": "42"}
            )
    check_one_sequence(store.sessions[session], expected.script, calls=CALLS)


async def messages(
    url: str, store: RolloutStore, session: str, expected: Expected, stream: bool
) -> None:
    import anthropic

    conversation: list[Any] = [{"role": "user", "content": expected.question}]
    tools: Any = [
        {
            "name": expected.call[0],
            "description": "Evaluate arithmetic.",
            "input_schema": PARAMETERS,
        }
    ]
    async with anthropic.AsyncAnthropic(base_url=f"{url}/s/{session}", api_key="key") as sdk:
        client: Any = sdk  # untyped: the checks read optional fields that this server always fills
        for _ in range(CALLS):
            if stream:
                async with client.messages.stream(
                    model=MODEL,
                    max_tokens=64,
                    system=SYSTEM,
                    messages=conversation,
                    tools=tools,
                    extra_body=GREEDY,
                ) as events:
                    message = await events.get_final_message()
            else:
                message = await client.messages.create(
                    model=MODEL,
                    max_tokens=64,
                    system=SYSTEM,
                    messages=conversation,
                    tools=tools,
                    extra_body=GREEDY,
                )
            assert message.stop_reason == "tool_use"
            uses = [block for block in message.content if block.type == "tool_use"]
            assert [(u.name, u.input) for u in uses] == [expected.call]
            assert [b.thinking for b in message.content if b.type == "thinking"] == [
                expected.reasoning
            ]
            conversation.append(
                {
                    "role": "assistant",
                    "content": [b.model_dump(exclude_none=True) for b in message.content],
                }
            )
            conversation.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": uses[0].id, "content": "42"}
                    ],
                }
            )
    check_one_sequence(store.sessions[session], expected.script, calls=CALLS)


ROUND_TRIPS: dict[str, Callable[[str, RolloutStore, str, Expected, bool], Awaitable[None]]] = {
    "chat": chat,
    "responses": responses,
    "messages": messages,
}
