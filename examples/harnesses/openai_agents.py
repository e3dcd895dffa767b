"""A tool-calling agent on openai-agents: `Agent` + `Runner` with a `function_tool` calculator.

The SDK runs with its defaults: the Responses API (POST {base}/responses) through an AsyncOpenAI
client built from OPENAI_BASE_URL and OPENAI_API_KEY. Tracing (which would upload to
api.openai.com) is the caller's to switch off with OPENAI_AGENTS_DISABLE_TRACING=1.

    PLAIT_MODEL=m OPENAI_BASE_URL=http://HOST:PORT/s/SESSION/v1 OPENAI_API_KEY=x \
        OPENAI_AGENTS_DISABLE_TRACING=1 \
        .venvs/harness/bin/python examples/harnesses/openai_agents.py "What is 17*23?"

The agent uses `tool_use_behavior="stop_on_first_tool"`, the SDK's setting for "compute it with
a tool" tasks: the first tool call's result is the final output, so a run is one model call
that calls the calculator (a model that answers in text instead ends the run with that text).
PLAIT_TOOL_CHOICE (e.g. "required") makes it a tool round trip instead: the first call is sent
with that `tool_choice` (`ModelSettings`; the SDK resets it to auto once a tool ran), and the
model answers from the tool's result (`run_llm_again`), in two model calls or more.
PLAIT_PARALLEL_TOOL_CALLS=0 sends `parallel_tool_calls: false` (one call per turn).
The prompt is PLAIT_PROMPT (else argv[1]); PLAIT_STREAM=1 runs it with `Runner.run_streamed`
(the requests then carry `stream: true`). The final answer is the last line of stdout; an agent
that runs out of turns prints an empty line and still exits 0.
"""

import asyncio
import os
import sys

from agents import Agent, MaxTurnsExceeded, ModelSettings, Runner, function_tool
from calculator import calculator

MAX_TURNS = 4


async def run(agent: Agent, prompt: str, stream: bool) -> str:
    try:
        if not stream:
            return str((await Runner.run(agent, prompt, max_turns=MAX_TURNS)).final_output)
        result = Runner.run_streamed(agent, prompt, max_turns=MAX_TURNS)
        async for _ in result.stream_events():
            pass
        return str(result.final_output)
    except MaxTurnsExceeded:
        return ""


def main() -> None:
    prompt = os.environ.get("PLAIT_PROMPT") or sys.argv[1]
    tool_choice = os.environ.get("PLAIT_TOOL_CHOICE")
    one_call = os.environ.get("PLAIT_PARALLEL_TOOL_CALLS") == "0"
    agent = Agent(
        name="calculator",
        instructions="Answer the question. Use the calculator tool for arithmetic.",
        # "openai/" names the SDK's default OpenAI provider explicitly; it is stripped before the
        # request, and without it a namespaced id such as Qwen/Qwen3-0.6B fails ("Unknown prefix")
        model=f"openai/{os.environ['PLAIT_MODEL']}",
        tools=[function_tool(calculator)],
        model_settings=ModelSettings(
            tool_choice=tool_choice,
            parallel_tool_calls=False if one_call else None,
        ),
        tool_use_behavior="run_llm_again" if tool_choice else "stop_on_first_tool",
    )
    answer = asyncio.run(run(agent, prompt, os.environ.get("PLAIT_STREAM") == "1"))
    print(answer.strip())


if __name__ == "__main__":
    main()
