"""The five example harnesses (examples/harnesses/) as they are, in the venv scripts/ci/harness.sh
builds, pointed at the proxy only by base URL and key: the plain openai and anthropic SDKs,
openai-agents, smolagents' ToolCallingAgent and mini-swe-agent, streaming and not, each finishing
its task through the proxy in front of plait-torch, and all of them in front of one vLLM server —
with, there, the SDKs' multi-turn tool round trips on every API (`plait_proxy.testing`), which
test_clients.py runs in front of plait-torch.

No real tool-calling model runs here: each harness gets tiny-qwen3 rewritten to write one fixed
completion whatever it is shown (`plait_testing.scripted`), so every harness is given a script
it finishes on in one model call — a plain answer for the two SDK programs (their tool loops are
test_clients.py's), a `calculator` call for openai-agents (which stops on its first tool's
result), `final_answer` for smolagents and a submitting `bash` command for mini-swe-agent. The
episode's session policy samples greedily, as the `proxy.harness` environment imposes the run's
sampling on a program: the harnesses ask for the API's default temperature, and the scripted
model's margins are small. Checked: the program's answer (its last line of stdout), the ids the
store recorded (the script's, as sampled), the tool call the proxy parsed, and that a streaming
harness sent `stream: true` and got an event stream (seen by a wrapper around the ASGI app; the
store does not record it).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from plait.api import ModelInput, ResolvedModel, SamplingParams, get_registry
from plait_proxy.app import ProxyApp, ServeOptions
from plait_proxy.proxy import Limits, Proxy
from plait_proxy.store import RolloutStore, SessionPolicy
from plait_proxy.testing import MODEL as ROUND_TRIP_MODEL, ROUND_TRIPS, Expected, run_program
from plait_testing.venvs import venv_python

pytestmark = pytest.mark.slow
pytest.importorskip("plait_qwen", reason="needs the Qwen renderers (plait-qwen)")

REPO = Path(__file__).resolve().parents[3]
PROGRAMS = REPO / "examples" / "harnesses"
NEWLINE = 198  # the last token of every Qwen generation prompt ("<|im_start|>assistant\n")
PROMPT = "What is 17*23?"
ANSWER = "391"
MODEL = "plait-scripted"
GREEDY = SessionPolicy(SamplingParams(temperature=0.0, max_tokens=128), max_calls=3)
PROGRAM_TIMEOUT_S = 300  # a program's imports alone take 5-15 s; the machine may be busy


@attrs.frozen
class Script:
    text: str
    tool_call: tuple[str, dict[str, Any]] | None = None


def _tool_call(name: str, arguments: dict[str, Any], thought: str) -> Script:
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return Script(
        f"<think>{thought}</think>\n\n\n<tool_call>{body}</tool_call><|im_end|>", (name, arguments)
    )


# token-distinct (see script_tokens)
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo $((17*23))"
SCRIPTS = {
    "answer": Script(f"<think>multiply</think>\n\n{ANSWER}<|im_end|>"),
    "calculator": _tool_call("calculator", {"expression": "17*23"}, "use the tool"),
    "final_answer": _tool_call("final_answer", {"answer": ANSWER}, "I know it"),
    "bash": _tool_call("bash", {"command": SUBMIT}, "run it"),
}


@attrs.frozen
class Harness:
    program: str
    script: str
    api: str
    """The API the program calls, as the store names it."""
    streams: bool
    env: dict[str, str] = attrs.field(factory=dict)


HARNESSES = {
    "openai_sdk": Harness("openai_sdk.py", "answer", "chat_completions", streams=True),
    "anthropic_sdk": Harness("anthropic_sdk.py", "answer", "messages", streams=True),
    "openai_agents": Harness("openai_agents.py", "calculator", "responses", streams=True),
    # smolagents' default tool_choice "required" would constrain decoding to the renderer's
    # tool-call grammar, which the script (a reasoning block, compact JSON) does not match, and
    # no script can: the grammar's "\n" after <tool_call> is token 198, the scripted model's
    # trigger. test_agent_round_trips.py runs smolagents' "required" on SmolLM2.
    "smolagents": Harness(
        "smolagents_agent.py",
        "final_answer",
        "chat_completions",
        streams=True,
        env={"PLAIT_TOOL_CHOICE": "auto"},
    ),
    "mini_swe": Harness(
        "mini_swe.py", "bash", "chat_completions", streams=False
    ),  # no streaming mode
}
CASES = [
    (name, stream)
    for name, harness in HARNESSES.items()
    for stream in (False, True)[: 1 + harness.streams]
]

ScriptedModels = Callable[[str], tuple[ResolvedModel, list[int]]]


@pytest.fixture(scope="session")
def harness_python() -> str:
    return venv_python("PLAIT_HARNESS_VENV", REPO / ".venvs" / "harness", "scripts/ci/harness.sh")


@pytest.fixture(scope="session")
def scripted_models(tiny_qwen3: ResolvedModel) -> ScriptedModels:
    """name -> (a tiny-qwen3 whose greedy completion of any prompt is SCRIPTS[name], its ids),
    each built on first use."""
    from plait_hf.chat_template import load_tokenizer
    from plait_testing.scripted import build_scripted_qwen3, script_tokens

    tokenizer = load_tokenizer(tiny_qwen3.path)
    built: dict[str, tuple[ResolvedModel, list[int]]] = {}

    def get(name: str) -> tuple[ResolvedModel, list[int]]:
        if name not in built:
            ids = script_tokens(tokenizer, SCRIPTS[name].text, avoid=[NEWLINE])
            dest = tiny_qwen3.path.parent / f"scripted-{name}"
            build_scripted_qwen3(tiny_qwen3.path, dest, NEWLINE, ids)
            built[name] = ResolvedModel(f"scripted-{name}", dest, dest), ids
        return built[name]

    return get


class RequestLog:
    """ASGI middleware that keeps, for each POST, its path, JSON body, status and content type."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        entry: dict[str, Any] = {"path": scope["path"]}
        self.requests.append(entry)
        body = bytearray()

        async def receive_and_keep() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
                if not message.get("more_body"):
                    entry["body"] = json.loads(body)
            return message

        async def send_and_keep(message: Any) -> None:
            if message["type"] == "http.response.start":
                entry["status"] = message["status"]
                entry["content_type"] = (
                    dict(message.get("headers", [])).get(b"content-type", b"").decode()
                )
            await send(message)

        await self.app(scope, receive_and_keep, send_and_keep)


class Served:
    """A proxy for `engine` served on a free port in this event loop, with its store and log."""

    def __init__(self, engine: Any, model: ResolvedModel, max_context_tokens: int = 32768) -> None:
        renderer = (
            get_registry().get("renderer", "qwen3_keep_reasoning").load()(model, options=None)
        )
        self.store = RolloutStore(auto_create=False)
        self.app = ProxyApp(
            Proxy(engine, renderer, MODEL, Limits(max_context_tokens=max_context_tokens)),
            self.store,
            ServeOptions(port=0, served_model_names=[ROUND_TRIP_MODEL]),
        )
        self.log = RequestLog(self.app.asgi)
        self.app.asgi = self.log  # what `serving` hands uvicorn


async def run_harness(
    python: str, url: str, served: Served, name: str, stream: bool, script: list[int], workdir: Path
) -> dict[str, Any]:
    """Run harness `name` against the proxy at `url` in a session of its own, check what it did
    and what the store recorded, and return a summary of it."""
    harness = HARNESSES[name]
    session_id = f"{name}-{'stream' if stream else 'whole'}"
    served.store.open(session_id).policy = GREEDY
    env = {
        "OPENAI_BASE_URL": f"{url}/s/{session_id}/v1",
        "OPENAI_API_KEY": session_id,
        "ANTHROPIC_BASE_URL": f"{url}/s/{session_id}",
        "ANTHROPIC_API_KEY": session_id,
        "PLAIT_MODEL": MODEL,
        "PLAIT_PROMPT": PROMPT,
        "PLAIT_STREAM": "1" if stream else "0",
        "OPENAI_AGENTS_DISABLE_TRACING": "1",
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(workdir / "mini-swe-agent"),  # not the user's ~/.config
        **harness.env,
    }
    run = await run_program(python, PROGRAMS / harness.program, env, workdir, PROGRAM_TIMEOUT_S)
    report = f"{name} (stream={stream}): {run.report(3000)}"
    assert run.returncode == 0, report
    assert (run.stdout.splitlines() or [""])[-1].strip() == ANSWER, report

    session = served.store.sessions[session_id]
    assert len(session.calls) == 1, report  # every script finishes its harness in one model call
    expected = SCRIPTS[harness.script].tool_call
    for call in session.calls:
        assert call.api == harness.api
        for choice in call.choices:
            assert list(choice.sequence.tokens) == script  # the ids as sampled
            assert [(t.name, t.arguments) for t in choice.message.tool_calls] == (
                [expected] if expected else []
            )
            assert choice.finish_reason == ("tool_calls" if expected else "stop")
            if expected is None:
                assert choice.message.content.strip() == ANSWER
    sent = [r for r in served.log.requests if r["path"].startswith(f"/s/{session_id}/")]
    assert len(sent) == len(session.calls), sent
    for request in sent:
        assert request["status"] == 200
        assert bool(request["body"].get("stream")) == stream, request["body"]
        assert request["content_type"].startswith(
            "text/event-stream" if stream else "application/json"
        )
    return {
        "harness": name,
        "stream": stream,
        "calls": len(session.calls),
        "api": harness.api,
        "prompt_tokens": [len(c.prompt_ids) for c in session.calls],
        "seconds": round(run.seconds, 1),
    }


async def sdk_round_trips(url: str, served: Served, script: list[int]) -> list[dict[str, Any]]:
    """plait_proxy.testing's tool round trips (two calls each, through the official SDKs) on every
    API, streaming and not, with the calculator script loaded."""
    expected = Expected(
        script,
        SCRIPTS["calculator"].tool_call or ("", {}),
        reasoning="use the tool",
        question=PROMPT,
    )
    done = []
    for api, round_trip in ROUND_TRIPS.items():
        for stream in (False, True):
            session = f"sdk-{api}-{stream}"
            served.store.open(session).policy = GREEDY
            await round_trip(url, served.store, session, expected, stream)
            done.append(
                {
                    "sdk_round_trip": api,
                    "stream": stream,
                    "calls": len(served.store.sessions[session].calls),
                }
            )
    return done


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("name", "stream"), CASES, ids=[f"{n}-{'stream' if s else 'whole'}" for n, s in CASES]
)
def test_harness_completes_its_task_through_the_proxy_on_plait_torch(
    name: str, stream: bool, harness_python: str, scripted_models: ScriptedModels, tmp_path: Path
) -> None:
    model, script = scripted_models(HARNESSES[name].script)

    async def go() -> dict[str, Any]:
        engine = get_registry().get("inference_engine", "torch").load()(model, options=None, seed=0)
        served = Served(engine, model)
        try:
            async with served.app.serving() as url:
                return await run_harness(
                    harness_python, url, served, name, stream, script, tmp_path
                )
        finally:
            await engine.close()

    print(asyncio.run(go()))


@pytest.mark.vllm
@pytest.mark.timeout(1800)  # vLLM (CPU) takes 1-2 minutes to start, more on a busy machine
def test_every_harness_completes_its_task_through_the_proxy_on_vllm(
    harness_python: str, scripted_models: ScriptedModels, tmp_path: Path
) -> None:
    """One vLLM server for all harnesses, switched between the scripted models (all tiny-qwen3's
    architecture) by loading their weights from disk."""
    pytest.importorskip("plait_vllm")
    from plait_vllm.engine import VLLMEngine
    from plait_vllm.options import VLLMOptions

    vllm_python = venv_python("PLAIT_VLLM_VENV", REPO / ".venvs" / "vllm", "scripts/ci/vllm.sh")
    order = sorted(CASES, key=lambda case: list(SCRIPTS).index(HARNESSES[case[0]].script))
    first, _ = scripted_models(HARNESSES[order[0][0]].script)
    max_model_len = 2048  # smolagents' prompt is 1,135 tokens, mini-swe-agent's 851
    options = VLLMOptions(
        python=vllm_python,
        dtype="float32",
        max_model_len=max_model_len,
        log_path=str(tmp_path / "vllm.log"),
    )

    async def go() -> list[dict[str, Any]]:
        engine = VLLMEngine(first, options=options, seed=0)  # the server starts in the background
        served = Served(engine, first, max_context_tokens=max_model_len)
        results = []
        loaded = HARNESSES[order[0][0]].script
        try:
            for name in SCRIPTS:  # meanwhile
                scripted_models(name)
            # wait for the server here rather than in the first program's request
            first_token = await engine.sample(
                ModelInput.from_ints([NEWLINE]), 1, SamplingParams(max_tokens=1, temperature=0)
            )
            assert list(first_token.sequences[0].tokens) == scripted_models(loaded)[1][:1]
            async with served.app.serving() as url:
                for name, stream in order:
                    wanted = HARNESSES[name].script
                    model, script = scripted_models(wanted)
                    if wanted != loaded:
                        await engine.load_weights_from_disk(
                            str(model.path), engine.weight_version + 1
                        )
                        loaded = wanted
                    workdir = tmp_path / f"{name}-{stream}"
                    workdir.mkdir()
                    results.append(
                        await run_harness(
                            harness_python, url, served, name, stream, script, workdir
                        )
                    )
                    if (name, stream) == (
                        "openai_agents",
                        False,
                    ):  # the calculator script is loaded:
                        results += await sdk_round_trips(
                            url, served, script
                        )  # tool loops on every API
        finally:
            await engine.close()
        return results

    for result in asyncio.run(go()):
        print(result)
