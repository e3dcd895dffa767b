"""OpenEnv both ways.

Default suite (no openenv-core needed: both sides speak its wire themselves): a plait environment
served with `OpenEnvServer` plays full multi-step episodes through plait's "openenv" environment
and plait's rollout; the wire matches OpenEnv's frames; `--protocol openenv` serves from the CLI
(started by the "openenv" environment's `command`); bad options, a missing package, a
non-numeric reward and a server that dies mid-episode give clear errors.

Interop (pytest -m interop; scripts/ci/sdk.sh builds .venvs/openenv with openenv-core 0.3.0,
whose gradio pin keeps it out of plait's .venv): the OpenEnv example
`examples/openenv/reverse_word` (openenv-core's `create_app`) is driven by plait's "openenv"
environment, and openenv-core's own `GenericEnvClient` plays an episode against
`plait env serve --protocol openenv`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import websockets

from plait.api import (
    ROLE_KEY,
    ConfigError,
    EnvironmentError_,
    EpisodeConfig,
    SamplingParams,
    ToolError,
    build,
    run_episode,
)
from plait_sdk import Environment, Split, TextBlock, ToolOutput, terminal
from plait_sdk.openenv_server import OpenEnvServer
from plait_sdk.server import serving
from plait_testing.replies import BytesRenderer, Replies

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "openenv" / "reverse_word"
VENVS = Path(os.environ.get("ORS_VENVS", ROOT / ".venvs"))
NUMBERS = [3, 7, 5]
SERVE_LETTERS = [sys.executable, "-m", "plait.cli", "env", "serve", "--protocol", "openenv"]
SERVE_LETTERS += ["fake.letters"]  # plait_testing.fakes' environment


class GuessEnv(Environment):
    """Guess a number below 10: 1.0 and done when right, else 0.0, a hint and another turn."""

    @classmethod
    def list_splits(cls) -> list[Split]:
        return [Split("train", "train")]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict]:
        return [{"number": n} for n in NUMBERS]

    def setup(self) -> None:
        self.tries = 0

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock("Guess my number (0-9).")]

    @terminal
    def guess(self, text: str) -> ToolOutput:
        """The model's guess."""
        self.tries += 1
        target = self.task_spec["number"]
        if text.strip() == str(target):
            return ToolOutput(blocks=[TextBlock("right")], reward=1.0, finished=True)
        hint = "higher" if text.strip().isdigit() and int(text) < target else "lower"
        return ToolOutput(
            blocks=[TextBlock(hint)], reward=0.0, finished=self.tries >= 3, metadata={ROLE_KEY: ""}
        )


async def play(env: Any, task: dict[str, Any], engine: Replies, max_turns: int = 4) -> Any:
    config = EpisodeConfig(SamplingParams(max_tokens=64), max_turns=max_turns)
    return await run_episode(env, task, engine, BytesRenderer(), config)


@asynccontextmanager
async def served(env: Any) -> AsyncIterator[str]:
    async with serving(OpenEnvServer(env).app, "127.0.0.1", 0, "OpenEnv server") as url:
        yield url


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# -- plait <-> plait over OpenEnv's wire (default suite) ----------------------------------------


def test_plait_env_served_over_openenv_plays_multi_step_episodes() -> None:
    async def main() -> None:
        async with served(GuessEnv) as url:
            env = build("env", "openenv", options={"url": url, "splits": {"train": [0, 1, 2]}})
            try:
                # seed 1 -> task 1 (number 7): a low guess, a high one, then the number
                engine = Replies("2", "9", "7")
                trajectory = await play(env, await env.get_task("train", 1), engine)
                assert list(trajectory.rewards) == [0.0, 0.0, 1.0]
                assert trajectory.finished and trajectory.error is None
                assert engine.prompts[0] == "user: Guess my number (0-9).\n"
                # each observation came back as the next user message
                assert engine.prompts[2].endswith("user: higher\nassistant: 9\nuser: lower\n")
                solved = await play(env, await env.get_task("train", 0), Replies("3"))
                assert list(solved.rewards) == [1.0] and solved.finished
            finally:
                await env.close()

    asyncio.run(main())


def test_messages_field_shows_the_served_environments_chat_messages() -> None:
    async def main() -> None:
        async with served(GuessEnv) as url:
            options = {"url": url, "splits": {"train": [1]}, "instructions": "Be brief."}
            chat = build("env", "openenv", options={**options, "messages_field": "messages"})
            wrong = build("env", "openenv", options={**options, "messages_field": "text"})
            try:
                engine = Replies("7")
                trajectory = await play(chat, await chat.get_task("train", 0), engine)
                assert list(trajectory.rewards) == [1.0]
                assert engine.prompts[0] == "system: Be brief.\nuser: Guess my number (0-9).\n"
                failed = await play(wrong, await wrong.get_task("train", 0), Replies("7"))
                assert failed.error is not None and "'text' (env.options.messages_field)" in (
                    failed.error
                )
            finally:
                await chat.close()
                await wrong.close()

    asyncio.run(main())


def test_the_wire_is_openenvs() -> None:
    """The frames OpenEnv's EnvClient sends and parses (openenv-core 0.3.0 env_client.py)."""

    async def main() -> None:
        async with served(GuessEnv) as url:
            ws_url = url.replace("http://", "ws://") + "/ws"
            async with websockets.connect(ws_url, proxy=None) as ws:

                async def ask(message: dict[str, Any]) -> dict[str, Any]:
                    await ws.send(json.dumps(message))
                    return json.loads(await ws.recv())

                reset = await ask({"type": "reset", "data": {"seed": 2}})
                assert reset["type"] == "observation"
                assert reset["data"]["reward"] is None and reset["data"]["done"] is False
                assert reset["data"]["observation"]["text"] == "Guess my number (0-9)."
                step = await ask({"type": "step", "data": {"message": "5"}})
                assert step == {
                    "type": "observation",
                    "data": {"observation": {"text": "right"}, "reward": 1.0, "done": True},
                }
                state = await ask({"type": "state"})
                assert state["type"] == "state" and state["data"]["step_count"] == 1
                bad = await ask({"type": "step", "data": {"text": "5"}})
                assert bad["type"] == "error" and bad["data"]["code"] == "VALIDATION_ERROR"
                assert "unknown action field text" in bad["data"]["message"]
                await ws.send(json.dumps({"type": "close"}))
            import aiohttp

            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/health") as answer:
                    assert await answer.json() == {"status": "healthy"}
                async with http.get(f"{url}/schema") as answer:
                    schema = await answer.json()
                assert set(schema) == {"action", "observation", "state"}
                assert "message" in schema["action"]["properties"]

    asyncio.run(main())


def test_cli_serves_openenv_and_the_server_dying_costs_the_episode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`plait env serve --protocol openenv`, started by the "openenv" environment's `command`;
    killing it mid-episode is the environment's failure, reported on that episode."""
    command = [*SERVE_LETTERS, "--port", "{port}"]
    monkeypatch.setenv("PLAIT_PLUGIN_MODULES", "plait_testing.fakes")  # the child serves it
    env = build("env", "openenv", options={"command": command})

    async def main() -> None:
        try:
            right = await play(env, await env.get_task("train", 0), Replies("cat"))
            wrong = await play(env, await env.get_task("train", 1), Replies("dog"))
            assert list(right.rewards) == [1.0] and list(wrong.rewards) == [0.0]
            session = await env.open(await env.get_task("train", 2))
            env._launched.process.kill()
            await env._launched.process.wait()
            output = await session.call("reply", {"text": "cat"})
            assert isinstance(output, ToolError) and output.reason == "exception"
            assert 'environment "openenv"' in output.error
            assert "failed during step" in output.error
            await session.close()
        finally:
            await env.close()

    asyncio.run(main())


# -- bad input ------------------------------------------------------------------------------------


def config_error(options: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as caught:
        build("env", "openenv", options=options, options_path="env.options")
    return caught.value.message


def test_bad_options_fail_naming_the_key(tmp_path: Path) -> None:
    assert "env.options.action_feild: unknown key" in config_error(
        {"url": "http://127.0.0.1:1", "action_feild": "x"}
    )
    assert 'did you mean "action_field"' in config_error(
        {"url": "http://127.0.0.1:1", "action_feild": "x"}
    )
    assert "exactly one of url" in config_error({})
    assert "exactly one of url" in config_error({"url": "http://a", "app": "m:app"})
    assert "app: 'server' is not 'module:attribute'" in config_error({"app": "server"})
    assert "command: no {port}" in config_error({"command": ["serve"]})
    assert "action_extra.message: that field gets the reply" in config_error(
        {"url": "http://a", "action_extra": {"message": "x"}}
    )
    assert "env.options.splits.train[0]: expected an integer" in config_error(
        {"url": "http://a", "splits": {"train": ["a"]}}
    )
    assert "split_reset.tset: no such split" in config_error(
        {"url": "http://a", "split_reset": {"tset": {"split": "test"}}}
    )


def test_missing_websockets_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "websockets", None)  # import websockets now raises
    message = config_error({"url": "http://127.0.0.1:1"})
    assert "needs the websockets package" in message
    assert "pip install 'plait-sdk[openenv]'" in message


def test_unreachable_server_is_an_environment_error() -> None:
    env = build("env", "openenv", options={"url": f"http://127.0.0.1:{free_port()}"})

    async def main() -> None:
        with pytest.raises(EnvironmentError_) as caught:
            await env.open({"seed": 0})
        assert 'environment "openenv": could not open an OpenEnv session' in caught.value.message
        assert caught.value.fix and "env.options.url" in caught.value.fix

    asyncio.run(main())


def test_wrong_action_field_is_caught_from_the_schema() -> None:
    async def main() -> None:
        async with served(GuessEnv) as url:
            env = build("env", "openenv", options={"url": url, "action_field": "answer"})
            with pytest.raises(EnvironmentError_) as caught:
                await env.open({"seed": 0})
            assert "it has no field answer" in caught.value.message
            assert caught.value.fix and "action_field" in caught.value.fix

    asyncio.run(main())


@asynccontextmanager
async def fake_openenv(step_answer: Any) -> AsyncIterator[str]:
    """A bare OpenEnv wire: reset observes "go", step answers `step_answer` (None: hang up)."""

    async def handler(ws: Any) -> None:
        async for raw in ws:
            kind = json.loads(raw)["type"]
            if kind == "reset":
                result = {"observation": {"prompt": "go"}, "reward": None, "done": False}
                await ws.send(json.dumps({"type": "observation", "data": result}))
            elif step_answer is None:
                return  # the connection drops mid-episode
            else:
                await ws.send(json.dumps({"type": "observation", "data": step_answer}))

    async with websockets.serve(handler, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        yield f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        ({"observation": {"prompt": "x"}, "reward": "high", "done": True}, "reward is 'high'"),
        ({"observation": {"prompt": "x"}, "reward": [1], "done": True}, "reward is [1]"),
        (None, "the connection closed mid-episode"),
    ],
)
def test_broken_step_answers_fail_the_episode_as_the_environments(
    answer: Any, problem: str
) -> None:
    async def main() -> None:
        async with fake_openenv(answer) as url:
            env = build("env", "openenv", options={"url": url})
            trajectory = await play(env, {"seed": 0}, Replies("hello"))
            assert trajectory.error is not None and problem in trajectory.error
            assert 'environment "openenv"' in trajectory.error

    asyncio.run(main())


# -- interop with openenv-core itself (its own venv) ----------------------------------------------


def openenv_python() -> str:
    python = VENVS / "openenv" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: run scripts/ci/sdk.sh (ORS_VENVS={VENVS})")
    return str(python)


@pytest.mark.interop
@pytest.mark.slow
def test_openenv_example_driven_by_plait() -> None:
    """examples/openenv/reverse_word, a real openenv-core server, through plait's rollout."""
    env = build(
        "env",
        "openenv",
        options={
            "app": "server.app:app",
            "app_dir": str(EXAMPLE),
            "python": openenv_python(),
            "observation_field": "prompt",
            "splits": {"train": [0, 1, 2]},
        },
    )
    import random

    words = ["planet", "garden", "silver", "window", "rocket", "candle", "forest", "bridge"]

    async def main() -> None:
        try:
            for seed in (0, 1, 2):
                word = random.Random(seed).choice(words)
                engine = Replies(word, word[::-1])
                trajectory = await play(env, {"seed": seed}, engine)
                assert list(trajectory.rewards) == [0.0, 1.0], trajectory.error
                assert trajectory.finished and f"'{word}' backwards" in engine.prompts[0]
                assert "user: Not quite; try again (2 left).\n" in engine.prompts[1]
            wrong = await play(env, {"seed": 0}, Replies("a", "b", "c"))
            assert list(wrong.rewards) == [0.0, 0.0, 0.0] and wrong.finished
        finally:
            await env.close()

    asyncio.run(main())


CLIENT = """
import asyncio, json, sys
from openenv.core.generic_client import GenericEnvClient

async def main():
    async with GenericEnvClient(base_url=sys.argv[1]) as env:
        first = await env.reset(seed=0)
        right = await env.step({"message": "cat"})
        state = await env.state()
        await env.reset(seed=1)
        wrong = await env.step({"message": "dog"})
    print(json.dumps([first.observation, right.reward, right.done, state, wrong.reward]))

asyncio.run(main())
"""


@pytest.mark.interop
@pytest.mark.slow
def test_openenv_core_client_plays_against_plait_serve() -> None:
    port = free_port()
    server = subprocess.Popen(
        [*SERVE_LETTERS, "--port", str(port)],
        env={**os.environ, "PLAIT_PLUGIN_MODULES": "plait_testing.fakes"},
    )
    try:
        import time

        deadline = time.monotonic() + 60
        while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
            assert server.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        out = subprocess.run(
            [openenv_python(), "-c", CLIENT, f"http://127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "NO_PROXY": "127.0.0.1,localhost"},
        )
        assert out.returncode == 0, out.stderr
        first, reward, done, state, wrong = json.loads(out.stdout)
        assert first["text"] == "task 0: answer with c" and first["messages"]
        assert (reward, done, wrong) == (1.0, True, 0.0)
        assert state["step_count"] == 1 and state["index"] == 0
    finally:
        server.terminate()
        server.wait(10)
