"""openai-agents and smolagents (examples/harnesses/, in the venv scripts/ci/harness.sh builds)
complete tool round trips through the proxy with a real model: SmolLM2-135M-Instruct on
plait-torch, its tool calls constrained by tool_choice "required" — the agent calls the calculator,
gets its result, and the model is called again with it, until the agent answers.

SmolLM2's own chat template shows no tools and cannot render a tool call, so the proxy serves it
with the `chat_template` renderer and TOOL_TEMPLATE: ChatML with the Hermes / Qwen2.5 tool format
(json `<tool_call>` blocks, results in `<tool_response>`) and SmolLM2's default system prompt.
Sampling is greedy (the episode's session policy), so every run is the same.

- openai-agents (Responses API) is run with PLAIT_TOOL_CHOICE=required: its first call is
  constrained to a calculator call, the SDK resets tool_choice to auto once the tool ran, and the
  model answers in text from the tool's result. Two calls; the second prompt continues the
  first's ids (the renderer's bridge).
- smolagents (Chat Completions) sends tool_choice "required" on every call and offers its
  `final_answer` tool beside the calculator. SmolLM2 calls the calculator first; on later steps
  it calls it again (never `final_answer`) or runs on inside the argument string until
  max_tokens, which smolagents takes as a failed step. After its 4 steps smolagents asks once
  more without tools and takes that text as the answer: five calls. smolagents re-renders its
  history as text, with the proxy's (random) call ids in it, so every prompt is rendered afresh
  and which of the two a later step does varies between runs.

Both run with PLAIT_PARALLEL_TOOL_CALLS=0 (one call per turn; SmolLM2 otherwise repeats a call,
and smolagents refuses a `final_answer` that comes with other calls). Checked: the program's
answer is the last reply's text; each tool result the client sent back is the calculator run on
the arguments it received; every recorded call's sampled ids decode, with the renderer's
tokenizer, to exactly the text and tool calls (name and arguments string) the client received.
Each runs whole and streaming (PLAIT_STREAM=1; smolagents' answer after its last step is never
streamed). The seconds of each program and call are printed (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from plait.api import ModelError, ResolvedModel, SamplingParams, get_registry
from plait_proxy.app import ProxyApp, ServeOptions
from plait_proxy.proxy import Proxy
from plait_proxy.store import RolloutStore, SessionPolicy
from plait_proxy.testing import run_program
from plait_testing.venvs import venv_python

pytestmark = pytest.mark.slow
pytest.importorskip("plait_torch", reason="needs the reference engine (plait-torch)")

REPO = Path(__file__).resolve().parents[3]
PROGRAMS = REPO / "examples" / "harnesses"
MODEL = "smollm2"
# Greedy SmolLM2 writes an empty expression for a bare "What is 17 * 23?"; named, it copies it.
PROMPT = 'What is 17 * 23? Call the calculator with the expression "17 * 23".'
POLICY = SessionPolicy(SamplingParams(temperature=0.0, max_tokens=96), max_calls=8)
PROGRAM_TIMEOUT_S = 600  # imports take 5-15 s, each call 2-10 s; a busy machine is slower

TOOL_TEMPLATE = """
{%- if messages and messages[0].role == "system" %}
{%- set system, rest = messages[0].content, messages[1:] %}
{%- else %}
{%- set system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face" %}
{%- set rest = messages %}
{%- endif %}
{{- "<|im_start|>system\\n" + system }}
{%- if tools %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
{{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{ "\\n" + (tool | tojson) }}{% endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and " }}
{{- "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n" }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' }}
{%- endif %}
{{- "<|im_end|>\\n" }}
{%- for message in rest %}
{%- if message.role == "assistant" %}
{{- "<|im_start|>assistant\\n" + (message.content or "") }}
{%- for call in message.tool_calls or [] %}
{%- if message.content or not loop.first %}{{ "\\n" }}{% endif %}
{%- set arguments = call.function.arguments %}
{{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- (arguments if arguments is string else arguments | tojson) + "}\\n</tool_call>" }}
{%- endfor %}
{{- "<|im_end|>\\n" }}
{%- elif message.role == "tool" %}
{%- if loop.first or loop.previtem.role != "tool" %}{{ "<|im_start|>user" }}{% endif %}
{{- "\\n<tool_response>\\n" + message.content + "\\n</tool_response>" }}
{%- if loop.last or loop.nextitem.role != "tool" %}{{ "<|im_end|>\\n" }}{% endif %}
{%- else %}
{{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>\\n" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ "<|im_start|>assistant\\n" }}{% endif %}
"""


@attrs.frozen
class Harness:
    program: str
    api: str
    """The API the program calls, as the store names it."""
    env: dict[str, str]
    bridged: bool
    """Every later prompt continues the ids of the call before (the client echoes answers)."""


HARNESSES = {
    "openai_agents": Harness(
        "openai_agents.py", "responses", {"PLAIT_TOOL_CHOICE": "required"}, bridged=True
    ),
    "smolagents": Harness("smolagents_agent.py", "chat_completions", {}, bridged=False),
}


@pytest.fixture(scope="session")
def harness_python() -> str:
    return venv_python("PLAIT_HARNESS_VENV", REPO / ".venvs" / "harness", "scripts/ci/harness.sh")


@pytest.fixture(scope="session")
def smollm2() -> ResolvedModel:
    from plait.components import resolve_model

    try:
        return resolve_model("smollm2-135m-instruct")
    except ModelError as exc:
        pytest.skip(f"{exc} ({exc.fix})")


def calculator(expression: str) -> str:
    """The harnesses' own calculator (examples/harnesses/calculator.py)."""
    spec = importlib.util.spec_from_file_location("calculator", PROGRAMS / "calculator.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.calculator(expression))


class Exchanges:
    """ASGI middleware that keeps each POST's JSON body, its reply (`read_reply`) and seconds."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.log: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        entry: dict[str, Any] = {"path": scope["path"], "started": time.monotonic()}
        self.log.append(entry)
        body, reply = bytearray(), bytearray()

        async def receive_and_keep() -> Any:
            message = await receive()
            body.extend(message.get("body", b""))
            if not message.get("more_body"):
                entry["request"] = json.loads(body)
            return message

        async def send_and_keep(message: Any) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
            elif message["type"] == "http.response.body":
                reply.extend(message.get("body", b""))
                if not message.get("more_body"):
                    entry["reply"] = read_reply(bytes(reply))
                    entry["seconds"] = round(time.monotonic() - entry["started"], 1)
            await send(message)

        await self.app(scope, receive_and_keep, send_and_keep)


def read_reply(body: bytes) -> Any:
    """A JSON reply, or an event stream's reply rebuilt: the chat chunks' message (its content and
    tool calls accumulated), or the Responses stream's completed response."""
    if not body.startswith(b"data:") and not body.startswith(b"event:"):
        return json.loads(body)
    events = [
        json.loads(line[len("data:") :])
        for line in body.decode().splitlines()
        if line.startswith("data:") and line != "data: [DONE]"
    ]
    if events and events[-1].get("type") == "response.completed":
        return events[-1]["response"]
    content, calls = "", {}
    for event in events:
        for choice in event.get("choices", []):
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for piece in delta.get("tool_calls") or []:
                call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
                call["id"] = piece.get("id", call.get("id"))
                function = piece.get("function") or {}
                call["function"]["name"] = function.get("name", call["function"].get("name"))
                call["function"]["arguments"] += function.get("arguments") or ""
    message = {"content": content, "tool_calls": [calls[k] for k in sorted(calls)]}
    return {"choices": [{"message": message}]}


def received(api: str, reply: dict[str, Any]) -> tuple[str, list[tuple[str, str, str]]]:
    """The text and the tool calls (id, name, arguments as sent) of a reply."""
    if api == "chat_completions":
        message = reply["choices"][0]["message"]
        return message.get("content") or "", [
            (c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
        ]
    output = reply["output"]
    text = "".join(
        p["text"] for item in output if item["type"] == "message" for p in item["content"]
    )
    calls = [
        (i["call_id"], i["name"], i["arguments"]) for i in output if i["type"] == "function_call"
    ]
    return text, calls


def as_sampled(text: str, calls: list[tuple[str, str, str]]) -> str:
    """The completion that writes `text` and `calls` in TOOL_TEMPLATE's format."""
    blocks = [
        f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for _, n, a in calls
    ]
    return "\n".join([text, *blocks] if text else blocks)


def check_tool_result(api: str, call: tuple[str, str, str], request: dict[str, Any]) -> None:
    """The client's next request holds the tool call as it received it, then the calculator's
    result on those arguments."""
    call_id, name, arguments = call
    assert name == "calculator"  # the only other tool, smolagents' final_answer, ends the run
    result = calculator(json.loads(arguments)["expression"])
    if api == "responses":
        items = request["input"]
        echoed = [i for i in items if i.get("type") == "function_call" and i["call_id"] == call_id]
        assert [(i["name"], i["arguments"]) for i in echoed] == [(name, arguments)]
        outputs = [i["output"] for i in items if i.get("call_id") == call_id and "output" in i]
        assert outputs == [result]
        return
    # smolagents: the call comes back as the repr of its dict, the result as the user message
    # after it (which its last call, asking for an answer, continues with the task)
    texts = [
        (
            m["role"],
            m["content"]
            if isinstance(m["content"], str)
            else "".join(p["text"] for p in m["content"]),
        )
        for m in request["messages"]
    ]
    at = next(k for k, (role, text) in enumerate(texts) if f"'id': '{call_id}'" in text)
    assert texts[at][0] == "assistant"
    assert f"'name': '{name}', 'arguments': {json.loads(arguments)!r}" in texts[at][1]
    role, text = texts[at + 1]
    assert role == "user" and (text + "\n").startswith(f"Observation:\n{result}\n"), texts


async def run_round_trip(
    python: str, model: ResolvedModel, name: str, stream: bool, workdir: Path
) -> dict[str, Any]:
    from plait_hf.chat_template import ChatTemplateOptions

    harness = HARNESSES[name]
    registry = get_registry()
    engine = registry.get("inference_engine", "torch").load()(model, options=None, seed=0)
    renderer = registry.get("renderer", "chat_template").load()(
        model, options=ChatTemplateOptions(chat_template=TOOL_TEMPLATE)
    )
    assert renderer.tool_call_format == "json"
    store = RolloutStore(auto_create=False)
    app = ProxyApp(Proxy(engine, renderer, MODEL), store, ServeOptions(port=0))
    exchanges = Exchanges(app.asgi)
    app.asgi = exchanges  # what `serving` hands uvicorn
    store.open(name).policy = POLICY
    try:
        async with app.serving() as url:
            env = {
                "OPENAI_BASE_URL": f"{url}/s/{name}/v1",
                "OPENAI_API_KEY": name,
                "PLAIT_MODEL": MODEL,
                "PLAIT_PROMPT": PROMPT,
                "PLAIT_PARALLEL_TOOL_CALLS": "0",
                "PLAIT_STREAM": "1" if stream else "0",
                "OPENAI_AGENTS_DISABLE_TRACING": "1",
                **harness.env,
            }
            program = PROGRAMS / harness.program
            run = await run_program(python, program, env, workdir, PROGRAM_TIMEOUT_S)
    finally:
        await engine.close()
    report = run.report(4000)
    assert run.returncode == 0, report

    sent = exchanges.log
    session = store.sessions[name]
    assert len(sent) == len(session.calls) >= 2, report  # a tool round trip: two calls or more
    assert all(e["status"] == 200 for e in sent), sent
    # smolagents' answer after its last step (provide_final_answer) is never streamed
    assert all(bool(e["request"].get("stream")) == stream for e in sent[: len(sent) - 1])
    first = sent[0]["request"]
    assert first["tool_choice"] == "required" and first["parallel_tool_calls"] is False
    tokenizer = renderer.tokenizer
    stops = set(renderer.stop_sequences())
    for exchange, call in zip(sent, session.calls, strict=True):
        assert call.api == harness.api
        (choice,) = call.choices
        tokens = list(choice.sequence.tokens)
        text, calls = received(harness.api, exchange["reply"])
        stop = tokens[-1:] if tokens[-1:] and tokens[-1] in stops else []
        assert tokenizer.decode(tokens[: len(tokens) - len(stop)], skip_special_tokens=False) == (
            as_sampled(text, calls)
        ), exchange["reply"]
        if call.prompt_source == "bridge":  # the prompt continues the ids of the call it extends
            parent = session.calls[call.parent[0]]
            before = [*parent.prompt_ids, *parent.choices[call.parent[1]].sequence.tokens]
            assert list(call.prompt_ids[: len(before)]) == before
        if exchange["request"].get("tool_choice") == "required":  # constrained, one a turn
            assert (len(calls), choice.finish_reason) in ((1, "tool_calls"), (0, "length")), (
                exchange["reply"]  # cut at max_tokens: SmolLM2 ran on inside a string
            )
    assert len(received(harness.api, sent[0]["reply"])[1]) == 1  # the first prompt is fixed
    if harness.bridged:
        assert {c.prompt_source for c in session.calls[1:]} == {"bridge"}
    for answered, following in itertools.pairwise(sent):
        for tool_call in received(harness.api, answered["reply"])[1]:
            check_tool_result(harness.api, tool_call, following["request"])
    answer, last_calls = received(harness.api, sent[-1]["reply"])
    if last_calls:  # smolagents' final_answer tool
        ((_, tool, arguments),) = last_calls
        assert tool == "final_answer"
        answer = str(json.loads(arguments)["answer"])
    assert answer.strip() and run.stdout.rstrip().endswith(answer.strip()), report
    return {
        "harness": name,
        "stream": stream,
        "calls": len(session.calls),
        "prompt_sources": [c.prompt_source for c in session.calls],
        "completion_tokens": [len(c.choices[0].sequence.tokens) for c in session.calls],
        "call_seconds": [e["seconds"] for e in sent],
        "program_seconds": round(run.seconds, 1),
    }


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("name", list(HARNESSES))
def test_agent_completes_a_constrained_tool_round_trip_on_smollm2(
    name: str, stream: bool, harness_python: str, smollm2: ResolvedModel, tmp_path: Path
) -> None:
    print(asyncio.run(run_round_trip(harness_python, smollm2, name, stream, tmp_path)))
