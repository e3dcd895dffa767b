"""A tool-calling agent on smolagents: `ToolCallingAgent` + `OpenAIServerModel` with a calculator
tool.

OpenAIServerModel (an alias of OpenAIModel in smolagents 1.26) builds an `openai.OpenAI()` client,
so with no api_base/api_key given it reads OPENAI_BASE_URL and OPENAI_API_KEY. It calls
POST {base}/chat/completions; the agent ends by calling its built-in `final_answer` tool (alone:
smolagents refuses a `final_answer` that comes with other tool calls in the same message).

    PLAIT_MODEL=m OPENAI_BASE_URL=http://HOST:PORT/s/SESSION/v1 OPENAI_API_KEY=x \
        .venvs/harness/bin/python examples/harnesses/smolagents_agent.py "What is 17*23?"

The prompt is PLAIT_PROMPT (else argv[1]); PLAIT_STREAM=1 sets `stream_outputs=True` (the
requests then carry `stream: true`). Every call is sent with `tool_choice: "required"` (the SDK's
default), or with PLAIT_TOOL_CHOICE when it is set; PLAIT_PARALLEL_TOOL_CALLS=0 adds
`parallel_tool_calls: false`, so that a model never sends `final_answer` beside another call
(which smolagents refuses). smolagents logs its steps to stdout; the final answer is the last
line.
"""

import os
import sys

from calculator import calculator
from smolagents import OpenAIServerModel, ToolCallingAgent, tool

MAX_STEPS = 4


def main() -> None:
    prompt = os.environ.get("PLAIT_PROMPT") or sys.argv[1]
    # the model's keyword arguments go into every request's body, over smolagents' own fields
    extra: dict[str, object] = {}
    if os.environ.get("PLAIT_TOOL_CHOICE"):
        extra["tool_choice"] = os.environ["PLAIT_TOOL_CHOICE"]
    if os.environ.get("PLAIT_PARALLEL_TOOL_CALLS") == "0":
        extra["parallel_tool_calls"] = False
    model = OpenAIServerModel(model_id=os.environ["PLAIT_MODEL"], **extra)
    agent = ToolCallingAgent(
        tools=[tool(calculator)],
        model=model,
        max_steps=MAX_STEPS,
        stream_outputs=os.environ.get("PLAIT_STREAM") == "1",
    )
    answer = agent.run(prompt)
    print(str(answer).strip())


if __name__ == "__main__":
    main()
