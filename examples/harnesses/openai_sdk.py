"""A tool-calling agent on the plain openai SDK: chat.completions with a calculator tool.

The client is configured only by the SDK's own variables, OPENAI_BASE_URL and OPENAI_API_KEY.

    PLAIT_MODEL=m OPENAI_BASE_URL=http://HOST:PORT/s/SESSION/v1 OPENAI_API_KEY=x \
        .venvs/harness/bin/python examples/harnesses/openai_sdk.py "What is 17*23?"

The prompt is PLAIT_PROMPT (else argv[1]); PLAIT_STREAM=1 streams each turn through the SDK's
`chat.completions.stream` helper. The final answer is the last line of stdout. A turn cut at the
token limit is taken as far as it got: the plain call returns it so, and the stream helper raises
LengthFinishReasonError holding it.
"""

import json
import os
import sys

from calculator import DESCRIPTION, NAME, PARAMETERS, calculator
from openai import LengthFinishReasonError, OpenAI

MAX_TURNS = 4
TOOLS = [
    {
        "type": "function",
        "function": {"name": NAME, "description": DESCRIPTION, "parameters": PARAMETERS},
    }
]


def main() -> None:
    prompt = os.environ.get("PLAIT_PROMPT") or sys.argv[1]
    model = os.environ["PLAIT_MODEL"]
    stream = os.environ.get("PLAIT_STREAM") == "1"
    client = OpenAI()
    messages: list = [{"role": "user", "content": prompt}]
    answer = ""
    for _ in range(MAX_TURNS):
        if stream:
            try:
                with client.chat.completions.stream(
                    model=model, messages=messages, tools=TOOLS
                ) as events:
                    message = events.get_final_completion().choices[0].message
            except LengthFinishReasonError as cut:
                message = cut.completion.choices[0].message
        else:
            message = (
                client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
                .choices[0]
                .message
            )
        messages.append(message)
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculator(json.loads(call.function.arguments)["expression"])
            except (ValueError, KeyError, TypeError) as e:
                result = f"error: bad arguments: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    print(answer.strip())


if __name__ == "__main__":
    main()
