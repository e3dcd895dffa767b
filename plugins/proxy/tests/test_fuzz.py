"""Bad input never breaks the proxy: 1,200 malformed requests to every API get a 4xx (never a 5xx)
with an error body in the API's own shape, the connection stays usable, and no session is left
behind by a request that was refused."""

from __future__ import annotations

import asyncio
import copy
import json
import random
from typing import Any

import httpx
import pytest

from plait.api import get_registry
from plait_proxy.app import ProxyApp, ServeOptions
from plait_proxy.proxy import Limits, Proxy
from plait_proxy.store import RolloutStore

pytest.importorskip("plait_qwen", reason="needs the Qwen renderers (plait-qwen)")

TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
VALID = {
    "chat/completions": {
        "model": "m",
        "max_tokens": 2,
        "messages": [
            {"role": "system", "content": "terse"},
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"e": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "1"},
        ],
        "tools": [TOOL],
    },
    "responses": {
        "model": "m",
        "max_output_tokens": 2,
        "instructions": "terse",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
        ],
        "tools": [{"type": "function", "name": "calculator", "parameters": {"type": "object"}}],
    },
    "messages": {
        "model": "m",
        "max_tokens": 2,
        "system": "terse",
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "calculator", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "1"}],
            },
        ],
        "tools": [{"name": "calculator", "input_schema": {"type": "object"}}],
    },
}
NASTY: list[Any] = [
    None,
    True,
    -1,
    0,
    10**30,
    1e308,
    -1e-308,
    "",
    "x" * 5000,
    [],
    {},
    [None],
    {"": None},
    "\u0000",
    "\ud800".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
    [[[]]],
    {"type": "function"},
    {"role": "wizard"},
    3.5,
    "auto",
    [{"type": "image_url"}],
]


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, child in value.items():
            found += paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += paths(child, (*prefix, index))
    return found


def mutate(body: dict[str, Any], rng: random.Random) -> dict[str, Any] | bytes:
    kind = rng.random()
    if kind < 0.08:
        return rng.choice(
            [
                b"",
                b"{",
                b"[1,2",
                b"\xff\xfe",
                b"null",
                b"[]",
                b'"s"',
                b"1" * 5000,
                b"[" * 10_000 + b"]" * 10_000,
                b'{"model": NaN}',
                b'{"max_tokens": 1e999}',
            ]
        )
    body = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        where = rng.choice(paths(body))
        parent = body
        for key in where[:-1]:
            parent = parent[key]
        if rng.random() < 0.3 and isinstance(parent, dict):
            parent.pop(where[-1], None)
        else:
            parent[where[-1]] = copy.deepcopy(rng.choice(NASTY))
    return body


@pytest.mark.timeout(600)
def test_malformed_requests_get_4xx_never_5xx_and_leak_no_session(tiny_qwen3: Any) -> None:
    registry = get_registry()
    engine = registry.get("inference_engine", "torch").load()(tiny_qwen3, options=None, seed=0)
    renderer = registry.get("renderer", "qwen3_keep_reasoning").load()(tiny_qwen3, options=None)
    store = RolloutStore()
    app = ProxyApp(Proxy(engine, renderer, "m", Limits(max_tokens=2)), store, ServeOptions(port=0))
    rng = random.Random(0)
    statuses: dict[int, int] = {}
    served_sessions: set[str] = set()

    async def go() -> None:
        async with app.serving() as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
            for i in range(1200):
                api = rng.choice(sorted(VALID))
                body = mutate(VALID[api], rng)
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                session = f"fuzz-{i % 50}"
                response = await client.post(
                    f"/s/{session}/v1/{api}",
                    content=content,
                    headers={"content-type": "application/json"},
                )
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                assert response.status_code < 500, (api, content[:300], response.text[:500])
                error = response.json()
                if response.status_code == 200:
                    served_sessions.add(session)
                elif api == "messages":
                    assert error["type"] == "error" and error["error"]["message"]
                else:
                    assert error["error"]["message"]
            assert (
                await client.get("/health")
            ).status_code == 200  # still serving, same connection
        await engine.close()

    asyncio.run(asyncio.wait_for(go(), 580))
    print("statuses:", dict(sorted(statuses.items())))
    refused = sum(n for status, n in statuses.items() if status != 200)
    assert refused >= 1000, statuses
    assert set(store.sessions) == served_sessions  # only requests that were served opened one
