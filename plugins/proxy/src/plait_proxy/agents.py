"""Agents for `proxy.harness`'s `function` option, written as any client of these APIs is: only
the base URL and key come from plait. They need the `openai` / `anthropic` SDKs."""

from __future__ import annotations

from plait_proxy.harness import AgentEpisode


async def openai_chat(episode: AgentEpisode) -> str:
    """One chat completion with the openai SDK: the task's messages in, the answer's text out."""
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=episode.openai_base_url, api_key=episode.api_key, max_retries=0) as client:
        response = await client.chat.completions.create(model=episode.model, messages=episode.messages)  # type: ignore[arg-type]
    return response.choices[0].message.content or ""
