"""Agents for `proxy.harness`'s `function` option, written as any client of these APIs is: only
the base URL and key come from plait. They need the `openai` SDK."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from plait_proxy.harness import AgentEpisode

_HTTP_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
    weakref.WeakKeyDictionary()
)


def _http_client() -> Any:
    """One connection pool per event loop for every episode's SDK client: building the SDK's
    default one (its TLS context) costs ~27 ms, more than the request."""
    import openai

    loop = asyncio.get_running_loop()
    if loop not in _HTTP_CLIENTS:
        _HTTP_CLIENTS[loop] = openai.DefaultAsyncHttpxClient()
    return _HTTP_CLIENTS[loop]


async def openai_chat(episode: AgentEpisode) -> str:
    """One chat completion with the openai SDK: the task's messages in, the answer's text out."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=episode.openai_base_url,
        api_key=episode.api_key,
        max_retries=0,
        http_client=_http_client(),
    )
    response = await client.chat.completions.create(model=episode.model, messages=episode.messages)  # type: ignore[arg-type]
    return response.choices[0].message.content or ""
