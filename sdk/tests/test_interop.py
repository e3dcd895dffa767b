"""Interop with the pinned official ORS SDKs, both ways (pytest -m interop; scripts/ci/sdk.sh
first).

- their clients (ors-sdk 0.1.0, openreward 0.1.167) play full episodes against plait's server;
- plait's client plays full episodes (and passes the contract kit) against their servers.

Their packages live in their own venvs (openreward pins sse-starlette), so their side runs as a
subprocess with that venv's python.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from plait.api import ToolError, ToolOutput
from plait_sdk import (
    Environment,
    Server,
    Split,
    TextBlock,
    ToolOutput as SDKToolOutput,
    terminal,
    tool,
)
from plait_sdk.client import ORSEnvironment, ORSOptions
from plait_testing.environment import check_environment

pytestmark = [pytest.mark.interop, pytest.mark.slow]

SDKS = ["ors", "openreward"]
INTEROP = Path(__file__).parent / "interop"
VENVS = Path(os.environ.get("ORS_VENVS", Path(__file__).resolve().parents[2] / ".venvs"))
VENV_DIRS = {"ors": "ors-sdk", "openreward": "openreward"}
ANSWERS = {"t0": "42", "t1": "72", "t2": "63", "t3": "12", "h0": "42"}


def venv_python(sdk: str) -> str:
    python = VENVS / VENV_DIRS[sdk] / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"{python} is missing: run scripts/ci/sdk.sh (ORS_VENVS={VENVS}) to build the "
            "official SDK venvs"
        )
    return str(python)


def subprocess_env() -> dict[str, str]:
    # No PyPI version check from openreward, no proxies for loopback.
    return {
        **os.environ,
        "OPENREWARD_DISABLE_UPDATE_CHECK": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


class FinalAnswerEnv(Environment):
    """A plait-native environment whose answer is the model's plain final message."""

    @classmethod
    def list_splits(cls) -> list[Split]:
        return [Split("train", "train")]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict]:
        return [{"question": "6 * 7?", "answer": "42"}]

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(self.task_spec["question"])]

    @terminal
    @tool
    def final(self, message: str) -> SDKToolOutput:
        """Grade the final message."""
        correct = self.task_spec["answer"] in message
        return SDKToolOutput(blocks=[TextBlock("graded")], reward=float(correct), finished=True)


# -- their clients against plait's server --------------------------------------------------------


@pytest.mark.parametrize("sdk", SDKS)
def test_official_client_plays_full_episodes_on_plait_server(sdk: str, ported_env: type) -> None:
    python = venv_python(sdk)
    server = Server([ported_env, FinalAnswerEnv])
    with server.serve_in_thread() as url:
        args = [python, str(INTEROP / "official_client.py"), sdk, url]
        if sdk == "openreward":
            args.append("with-terminal-env")
        done = subprocess.run(
            args, capture_output=True, text=True, timeout=240, env=subprocess_env()
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        _wait_until_empty(server)

    discovery = result["discovery"]
    assert discovery["splits"] == ["train", "holdout"]
    assert discovery["num_tasks"] == 4
    assert discovery["task1"]["id"] == "t1"
    assert discovery["range"] == ["t1", "t2"]
    assert discovery["tools"] == ["answer", "hint", "note", "whoami"]
    episodes = result["episodes"]
    assert len(episodes) == 4
    for i, ep in enumerate(episodes):
        assert ep["tools"] == ["answer", "hint", "note", "whoami"]
        assert ep["rewards"] == [-0.1, 0.0, 1.0]
        assert ep["finished"] == [False, False, True]
        assert ep["final_text"] == "Correct!"
        assert ep["metadata"] == {"notes": 1}
        assert ep["whoami"] == ("token=s3cret" if i < 3 else "token=")
        assert "not a valid tool" in ep["unknown_tool"]
        assert "validation error" in ep["invalid_input"]
        assert "episode has finished" in ep["after_finished"]
    if sdk == "openreward":
        assert discovery["bare_splits"] == ["train", "holdout"]
        assert discovery["messages"] == [["user", "What is 17 + 25?"]]
        assert discovery["terminal"] is False
        assert discovery["terminal_env"] == {"is_final": True, "tools": [], "result": 1.0}


def _wait_until_empty(server: Server) -> None:
    deadline = time.monotonic() + 10
    while server.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.sessions, f"sessions leaked: {sorted(server.sessions)}"


# -- plait's client against their servers -------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(params=SDKS)
def official_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    sdk = request.param
    port = _free_port()
    process = subprocess.Popen(
        [venv_python(sdk), str(INTEROP / "serve_arith_env.py"), sdk, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=subprocess_env(),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                pytest.fail(f"the {sdk} server exited: {process.stdout.read().decode()[-3000:]}")  # type: ignore[union-attr]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the {sdk} server did not answer /health within 90 s")
            time.sleep(0.2)
        yield sdk, url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _solve(task: dict) -> list[tuple[str, dict]]:
    return [("hint", {}), ("note", {"text": "x"}), ("answer", {"answer": ANSWERS[task["id"]]})]


def test_plait_client_passes_contract_kit_on_official_server(
    official_server: tuple[str, str],
) -> None:
    _sdk, url = official_server

    async def run() -> None:
        env = ORSEnvironment(ORSOptions(url=url, env_name="arithenv"))
        try:
            report = await check_environment(env, solve=_solve, reward_range=(-1.0, 1.0))
        finally:
            await env.close()
        assert report.episodes_finished == 3
        assert report.splits == ["train", "holdout"]

    asyncio.run(run())


def test_plait_client_plays_full_episodes_on_official_server(
    official_server: tuple[str, str],
) -> None:
    _sdk, url = official_server

    async def run() -> None:
        env = ORSEnvironment(ORSOptions(url=url))  # env_name from /list_environments
        try:
            assert [s.name for s in await env.splits()] == ["train", "holdout"]
            assert await env.num_tasks("train") == 4
            for index in range(4):
                task = await env.get_task("train", index)
                session = await env.open(task, secrets={"TOKEN": "s3cret"})
                try:
                    assert [b.text for b in await session.prompt()] == [task["question"]]
                    assert (await session.messages())[0].content == task[
                        "question"
                    ]  # /messages or fallback
                    assert sorted(t.name for t in await session.tools()) == [
                        "answer",
                        "hint",
                        "note",
                        "whoami",
                    ]
                    who = await session.call("whoami", {})
                    assert (
                        isinstance(who, ToolOutput) and who.text == "token=s3cret"
                    )  # header or body
                    hint = await session.call("hint", {})
                    assert isinstance(hint, ToolOutput) and hint.reward == pytest.approx(-0.1)
                    unknown = await session.call("no_such_tool", {})
                    assert isinstance(unknown, ToolError) and unknown.reason == "not_found"
                    bad = await session.call("answer", {"answer": 42})
                    assert isinstance(bad, ToolError) and bad.reason == "input_validation"
                    final = await session.call("answer", {"answer": ANSWERS[task["id"]]})
                    assert isinstance(final, ToolOutput) and final.reward == 1.0 and final.finished
                    again = await session.call("answer", {"answer": ANSWERS[task["id"]]})
                    assert isinstance(again, ToolError) and again.reason == "episode_finished"
                finally:
                    await session.close()
        finally:
            await env.close()

    asyncio.run(run())
