"""A tool-calling agent on the plain anthropic SDK: messages with a calculator tool.

The client is configured only by the SDK's own variables, ANTHROPIC_BASE_URL (the SDK appends
/v1/messages) and ANTHROPIC_API_KEY.

    PLAIT_MODEL=m ANTHROPIC_BASE_URL=http://HOST:PORT/s/SESSION ANTHROPIC_API_KEY=x \
        .venvs/harness/bin/python examples/harnesses/anthropic_sdk.py "What is 17*23?"

The prompt is PLAIT_PROMPT (else argv[1]); PLAIT_STREAM=1 streams each turn through the SDK's
`messages.stream` helper. The final answer is the last line of stdout.
"""

import os
import sys

from anthropic import Anthropic
from calculator import DESCRIPTION, NAME, PARAMETERS, calculator

MAX_TURNS = 4
MAX_TOKENS = 1024
TOOLS = [{"name": NAME, "description": DESCRIPTION, "input_schema": PARAMETERS}]


def main() -> None:
    prompt = os.environ.get("PLAIT_PROMPT") or sys.argv[1]
    model = os.environ["PLAIT_MODEL"]
    stream = os.environ.get("PLAIT_STREAM") == "1"
    client = Anthropic()
    messages: list = [{"role": "user", "content": prompt}]
    answer = ""
    for _ in range(MAX_TURNS):
        request = dict(model=model, max_tokens=MAX_TOKENS, messages=messages, tools=TOOLS)
        if stream:
            with client.messages.stream(**request) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**request)
        messages.append({"role": "assistant", "content": message.content})
        answer = "".join(block.text for block in message.content if block.type == "text")
        calls = [block for block in message.content if block.type == "tool_use"]
        if not calls:
            break
        results = []
        for call in calls:
            args = call.input if isinstance(call.input, dict) else {}
            result = calculator(str(args.get("expression", "")))
            results.append({"type": "tool_result", "tool_use_id": call.id, "content": result})
        messages.append({"role": "user", "content": results})
    print(answer.strip())


if __name__ == "__main__":
    main()
