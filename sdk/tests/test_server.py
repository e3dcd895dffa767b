"""plait's ORS server and client together: resume, 503 + Retry-After, pings, reaper, auth,
fall-backs."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter as Tally
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import httpx
import pytest
from click.testing import CliRunner

from plait.api import ConfigError, PlaitError, ToolError, ToolOutput, build
from plait_sdk import Environment, Server, ServerOptions, Split, TextBlock, tool
from plait_sdk.client import ORSEnvironment, ORSOptions, ServerError, retry_after_seconds
from plait_sdk.plugin import plait_register_commands
from plait_sdk.server import _send_json as send_json
from plait_sdk.types import INCLUDE_HEADER

CALLS: list[str] = []
TEARDOWNS: list[int] = []


class Slow(Environment):
    """Tools that take a while; setup can be made slow or failing through the task."""

    @classmethod
    def list_splits(cls) -> list[Split]:
        return [Split("train", "train")]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict]:
        return [{"n": i, "setup_s": 0.0} for i in range(3)]

    async def setup(self) -> None:
        await asyncio.sleep(float(self.task_spec.get("setup_s", 0.0)))
        if self.task_spec.get("fail"):
            raise RuntimeError("setup exploded")

    def teardown(self) -> None:
        TEARDOWNS.append(self.task_spec.get("n", -1))

    def get_prompt(self) -> list[TextBlock]:
        return [TextBlock(f"n={self.task_spec['n']} secret={self.secrets.get('KEY', '')}")]

    @tool
    async def work(self, seconds: float = 0.0) -> ToolOutput:
        """Sleep, then answer with a long text (several SSE chunks)."""
        CALLS.append("work")
        await asyncio.sleep(seconds)
        return ToolOutput(
            blocks=[TextBlock(" x" * 6000)], reward=0.5, metadata={"n": self.task_spec["n"]}
        )

    @tool
    def done(self) -> ToolOutput:
        return ToolOutput(blocks=[TextBlock("bye")], reward=1.0, finished=True)

    async def score_group(self, candidates: Sequence[dict[str, Any]]) -> list[float]:
        return [float(len(c["messages"])) for c in candidates]


def sid_of(client: httpx.Client) -> str:
    text = client.post("/create_session").text
    return text.split("event: task_id\ndata: ")[1].split("\n")[0]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_long_results_arrive_in_chunks_that_never_start_with_whitespace() -> None:
    server = Server([Slow])
    with server.serve_in_thread() as url, httpx.Client(base_url=url) as client:
        sid = sid_of(client)
        client.post("/create", json={"split": "train", "index": 0}, headers={"X-Session-ID": sid})
        text = client.post(
            "/slow/call", json={"name": "work", "input": {}}, headers={"X-Session-ID": sid}
        ).text
        client.post("/delete", headers={"X-Session-ID": sid})
    pieces = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")][1:]
    assert len(pieces) >= 3 and text.count("event: chunk") == len(pieces) - 1
    assert all(piece and not piece[0].isspace() for piece in pieces)
    assert json.loads("".join(pieces))["output"]["reward"] == 0.5


class DroppingProxy:
    """A loopback TCP proxy that cuts the first /call stream right after its task_id event has
    reached the client (so the client holds a resume token but no result)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.drops = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        state = {"call": False}

        async def upstream() -> None:
            while data := await reader.read(65536):
                state["call"] = b"/call " in data
                up_writer.write(data)
                await up_writer.drain()

        async def downstream() -> None:
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()
                if state["call"] and self.drops == 0 and b"event: task_id" in data:
                    self.drops += 1
                    return  # the connection dies mid-stream

        tasks = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            writer.close()
            up_writer.close()


def test_client_resumes_a_dropped_call_stream_without_running_the_tool_twice() -> None:
    server = Server([Slow])
    with server.serve_in_thread() as url:

        async def go() -> tuple[Any, int]:
            proxy = DroppingProxy(int(url.rsplit(":", 1)[1]))
            port = await proxy.start()
            env = ORSEnvironment(ORSOptions(url=f"http://127.0.0.1:{port}", backoff_base_s=0.05))
            session = await env.open(await env.get_task("train", 0))
            CALLS.clear()
            result = await session.call("work", {"seconds": 0.3})
            await session.close()
            await env.close()
            proxy.server.close()
            return result, proxy.drops

        result, drops = run(go())
    assert drops == 1
    assert isinstance(result, ToolOutput) and result.reward == 0.5 and len(result.text) == 12000
    assert CALLS == ["work"]  # resumed by task_id, not re-run


def test_unknown_task_id_is_a_404_for_that_session() -> None:
    server = Server([Slow])
    with server.serve_in_thread() as url, httpx.Client(base_url=url) as client:
        sid = sid_of(client)
        client.post("/create", json={"split": "train", "index": 0}, headers={"X-Session-ID": sid})
        answer = client.post(
            "/call",
            json={"name": "work", "input": {}, "task_id": "abc"},
            headers={"X-Session-ID": sid},
        )
        client.post("/delete", headers={"X-Session-ID": sid})
    assert answer.status_code == 404 and "unknown task_id 'abc'" in answer.json()["detail"]


def test_503_with_retry_after_while_setup_runs_and_the_client_waits_it_out() -> None:
    statuses: Tally[int] = Tally()
    server = Server([Slow], options=ServerOptions(setup_wait_s=0.1, retry_after_s=1))
    inner = server.app

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        async def record(message: dict) -> None:
            if message["type"] == "http.response.start" and scope["path"].endswith("/prompt"):
                statuses[message["status"]] += 1
            await send(message)

        await inner(scope, receive, record)

    server.app = counting
    task = {"n": 7, "setup_s": 1.5}
    with server.serve_in_thread() as url:
        with httpx.Client(base_url=url) as client:
            sid = sid_of(client)
            client.post("/create", json={"task_spec": task}, headers={"X-Session-ID": sid})
            early = client.get("/prompt", headers={"X-Session-ID": sid})
            client.post("/delete", headers={"X-Session-ID": sid})
        assert early.status_code == 503
        assert (
            early.headers["Retry-After"] == "1" and early.headers["X-Backend-State"] == "starting"
        )
        assert "still running setup()" in early.json()["detail"]

        async def go() -> str:
            env = ORSEnvironment(ORSOptions(url=url))
            session = await env.open(task)
            try:
                return (await session.prompt())[0].text
            finally:
                await session.close()
                await env.close()

        assert run(go()) == "n=7 secret="
    assert statuses[503] >= 2 and statuses[200] == 1


def test_retry_after_parsing() -> None:
    assert retry_after_seconds("2") == 2.0
    assert retry_after_seconds(None) is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert retry_after_seconds("soon") is None


def test_keep_alive_pings_while_a_tool_runs() -> None:
    server = Server([Slow], options=ServerOptions(ping_interval_s=0.1))
    with server.serve_in_thread() as url, httpx.Client(base_url=url) as client:
        sid = sid_of(client)
        client.post("/create", json={"split": "train", "index": 0}, headers={"X-Session-ID": sid})
        text = client.post(
            "/call",
            json={"name": "work", "input": {"seconds": 0.45}},
            headers={"X-Session-ID": sid},
        ).text
        client.post("/delete", headers={"X-Session-ID": sid})
    assert text.count(": ping - ") >= 2
    assert text.index(": ping - ") > text.index("event: task_id") and text.rstrip().endswith("}}")


def test_reaper_deletes_idle_sessions_and_client_pings_keep_sessions_alive() -> None:
    # The TTL leaves the pinging client (every 0.1 s) 20 intervals of slack on a loaded machine.
    server = Server([Slow], options=ServerOptions(session_ttl_s=2.0, reaper_interval_s=0.05))
    TEARDOWNS.clear()
    with server.serve_in_thread() as url:

        async def go() -> tuple[int, str]:
            env = ORSEnvironment(ORSOptions(url=url, ping_interval_s=0.1))
            kept = await env.open({"n": 1})
            async with httpx.AsyncClient(base_url=url) as client:
                sid = (await client.post("/create_session")).text.split("data: ")[1].split("\n")[0]
                await client.post(
                    "/create", json={"task_spec": {"n": 2}}, headers={"X-Session-ID": sid}
                )
                for _ in range(400):  # until the reaper has taken the idle session
                    if sid not in server.sessions:
                        break
                    await asyncio.sleep(0.05)
                idle = await client.get("/prompt", headers={"X-Session-ID": sid})
            prompt = (await kept.prompt())[0].text
            await kept.close()
            await env.close()
            return idle.status_code, prompt

        idle_status, prompt = run(go())
    assert idle_status == 404 and prompt.startswith("n=1")
    assert not server.sessions and sorted(TEARDOWNS) == [1, 2]


def test_a_session_in_use_outlives_a_short_ttl_and_expires_once_idle() -> None:
    # Neither side pings during the test (both every 10 s): only the setup wait and the call
    # itself can keep the session alive. The reaper used to delete it halfway through both.
    server = Server([Slow], options=ServerOptions(session_ttl_s=0.5, reaper_interval_s=0.05))
    TEARDOWNS.clear()
    with server.serve_in_thread() as url:

        async def go() -> tuple[Any, Any, bool, Any]:
            env = ORSEnvironment(ORSOptions(url=url))
            session = await env.open({"n": 1, "setup_s": 0.8})  # /create waits for setup
            try:
                long_call = await session.call("work", {"seconds": 1.5})
                next_call = await session.call("work", {})
                usable = session.sid in server.sessions
                for _ in range(400):  # until the reaper has taken the now idle session
                    if session.sid not in server.sessions:
                        break
                    await asyncio.sleep(0.05)
                async with httpx.AsyncClient(base_url=url) as client:
                    idle = await client.post("/ping", headers={"X-Session-ID": session.sid})
            finally:
                await session.close()
                await env.close()
            return long_call, next_call, usable, idle

        long_call, next_call, usable, idle = run(go())
    assert isinstance(long_call, ToolOutput) and long_call.metadata == {"n": 1}
    assert isinstance(next_call, ToolOutput) and usable
    assert idle.status_code == 404 and "expired after 0.5 s" in idle.json()["detail"]
    assert TEARDOWNS == [1]


def test_a_ttl_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="session_ttl_s"):
        ServerOptions(session_ttl_s=0)

    @click.group()
    def cli() -> None:
        pass

    plait_register_commands(cli)
    refused = CliRunner().invoke(cli, ["env", "serve", "any:Env", "--session-ttl", "0"])
    assert refused.exit_code == 2 and "'--session-ttl'" in refused.output


def test_api_key_is_required_when_set() -> None:
    server = Server([Slow], options=ServerOptions(api_key="k3y"))
    with server.serve_in_thread() as url:
        assert httpx.get(f"{url}/health").status_code == 200
        refused = httpx.get(f"{url}/slow/splits")
        assert refused.status_code == 401 and "X-API-Key" in refused.json()["detail"]
        assert (
            httpx.get(f"{url}/slow/splits", headers={"Authorization": "Bearer k3y"}).status_code
            == 200
        )

        async def go() -> None:
            good = ORSEnvironment(ORSOptions(url=url, api_key="k3y"))
            session = await good.open({"n": 0})
            assert isinstance(await session.call("done", {}), ToolOutput)
            await session.close()
            await good.close()
            bad = ORSEnvironment(ORSOptions(url=url, api_key="wrong"))
            with pytest.raises(ServerError, match="answered 401") as raised:
                await bad.splits()
            assert "api_key" in (raised.value.fix or "")
            await bad.close()

        run(go())


def test_refuses_to_serve_beyond_loopback_without_an_api_key() -> None:
    with pytest.raises(PlaitError, match="not a loopback address"):
        Server([Slow]).run(host="0.0.0.0", port=1)


def test_fall_backs_for_a_server_without_task_tools_and_messages() -> None:
    server = Server([Slow])
    inner = server.app

    async def older(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":  # nor does it know the X-Plait-Include extension
            scope = {
                **scope,
                "headers": [
                    (k, v) for k, v in scope["headers"] if k != INCLUDE_HEADER.lower().encode()
                ],
            }
        if scope["type"] == "http" and scope["path"].endswith(("/task_tools", "/messages")):
            await send_json(send, 404, b'{"detail":"Not Found"}')
            return
        await inner(scope, receive, send)

    server.app = older
    with server.serve_in_thread() as url:

        async def go() -> tuple[list[str], str]:
            env = ORSEnvironment(ORSOptions(url=url))
            session = await env.open({"n": 3})
            try:
                return [t.name for t in await session.tools()], (await session.messages())[
                    0
                ].content
            finally:
                await session.close()
                await env.close()

        tools, message = run(go())
    assert tools == ["done", "work"] and message == "n=3 secret="


def test_create_includes_the_messages_and_tools_a_plait_client_asks_for() -> None:
    server = Server([Slow], options=ServerOptions(setup_wait_s=0.2))
    seen: list[str] = []
    inner = server.app

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append(scope["path"])
        await inner(scope, receive, send)

    server.app = counting
    include = {"X-Plait-Include": "messages, task_tools"}
    with server.serve_in_thread() as url, httpx.Client(base_url=url) as client:
        created = client.post(
            "/create", json={"task_spec": {"n": 1}}, headers={"X-Session-ID": "a", **include}
        ).json()
        assert created["messages"] == client.get("/messages", headers={"X-Session-ID": "a"}).json()
        assert (
            created["task_tools"] == client.get("/task_tools", headers={"X-Session-ID": "a"}).json()
        )
        plain = client.post(
            "/create", json={"task_spec": {"n": 1}}, headers={"X-Session-ID": "b"}
        ).json()
        # what setup cannot give (it failed, or is still running) is left out: the route says why
        failed = client.post(
            "/create",
            json={"task_spec": {"n": 0, "fail": True}},
            headers={"X-Session-ID": "c", **include},
        )
        slow = client.post(
            "/create",
            json={"task_spec": {"n": 0, "setup_s": 1.0}},
            headers={"X-Session-ID": "d", **include},
        ).json()
        assert client.get("/messages", headers={"X-Session-ID": "c"}).status_code == 422
        seen.clear()

        async def episode() -> tuple[list[str], str, ToolOutput | ToolError]:
            env = ORSEnvironment(ORSOptions(url=url))
            session = await env.open({"n": 2})
            try:
                tools = [t.name for t in await session.tools()]
                message, output = (
                    (await session.messages())[0].content,
                    await session.call("done", {}),
                )
                await session.messages()  # after a call: asked anew
                return tools, message, output
            finally:
                await session.close()
                await env.close()

        tools, message, output = run(episode())
    assert plain == {"sid": "b"} and failed.status_code == 200 and failed.json() == {"sid": "c"}
    assert slow == {"sid": "d"}
    assert tools == ["done", "work"] and message == "n=2 secret=" and isinstance(output, ToolOutput)
    assert [path for path in seen if path != "/list_environments"] == [
        "/create",
        "/slow/call",
        "/slow/messages",
        "/delete",
    ]


def test_a_session_deleted_while_create_waits_for_setup_gets_no_includes() -> None:
    with Server([Slow]).serve_in_thread() as url, httpx.Client(base_url=url, timeout=10) as client:

        def create() -> Any:
            return client.post(
                "/create",
                json={"task_spec": {"n": 1, "setup_s": 0.6}},
                headers={"X-Session-ID": "gone", "X-Plait-Include": "messages,task_tools"},
            )

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            creating = pool.submit(create)
            time.sleep(0.2)
            deleted = client.post("/delete", headers={"X-Session-ID": "gone"})
            created = creating.result()
    assert (
        deleted.status_code == 200
        and created.status_code == 200
        and created.json() == {"sid": "gone"}
    )


def test_a_409_to_a_first_create_is_an_error_not_a_session() -> None:
    server = Server([Slow])
    inner = server.app

    async def conflicting(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/create":
            await send_json(send, 409, b'{"detail":"taken"}')
            return
        await inner(scope, receive, send)

    server.app = conflicting
    with server.serve_in_thread() as url:

        async def go() -> None:
            env = ORSEnvironment(ORSOptions(url=url))
            try:
                await env.open({"n": 0})
            finally:
                await env.close()

        with pytest.raises(ServerError, match="409") as raised:
            run(go())
    assert raised.value.status == 409


def test_a_create_that_timed_out_waiting_for_setup_still_opens_its_session() -> None:
    # the client gives up on /create (its includes wait for a 1.5 s setup) and sends it again:
    # the 409 that answers its own session id means the first attempt made the session
    with Server([Slow]).serve_in_thread() as url:

        async def go() -> tuple[str, ToolOutput | ToolError]:
            env = ORSEnvironment(
                ORSOptions(url=url, request_timeout_s=0.5, backoff_base_s=0.2, max_retries=10)
            )
            session = await env.open({"n": 1, "setup_s": 1.5})
            try:
                return (await session.messages())[0].content, await session.call("done", {})
            finally:
                await session.close()
                await env.close()

        message, output = run(go())
    assert message == "n=1 secret=" and isinstance(output, ToolOutput) and output.finished


def test_secrets_arrive_from_the_header_or_the_body() -> None:
    server = Server([Slow])
    with server.serve_in_thread() as url, httpx.Client(base_url=url) as client:
        prompts = []
        for headers, extra in (
            (
                {
                    "X-Secrets": base64.b64encode(
                        json.dumps({"KEY": {"value": "h"}}).encode()
                    ).decode()
                },
                {},
            ),
            ({}, {"secrets": {"KEY": "b"}}),
        ):
            sid = sid_of(client)
            client.post(
                "/create",
                json={"task_spec": {"n": 0}, **extra},
                headers={"X-Session-ID": sid, **headers},
            )
            prompts.append(client.get("/prompt", headers={"X-Session-ID": sid}).json()[0]["text"])
            client.post("/delete", headers={"X-Session-ID": sid})
        bad = client.post(
            "/create",
            json={"task_spec": {"n": 0}},
            headers={"X-Session-ID": "s", "X-Secrets": "%%"},
        )
    assert prompts == ["n=0 secret=h", "n=0 secret=b"]
    assert bad.status_code == 400 and "base64" in bad.json()["detail"]


def test_setup_failure_is_a_422_for_a_client_task_and_a_500_for_the_servers_own() -> None:
    class OwnFails(Slow):
        @classmethod
        def list_tasks(cls, split: str) -> list[dict]:
            return [{"n": 0, "fail": True}]

    server = Server([OwnFails])
    with server.serve_in_thread() as url, httpx.Client(base_url=url) as client:
        answers = []
        for body in ({"task_spec": {"n": 0, "fail": True}}, {"split": "train", "index": 0}):
            sid = sid_of(client)
            client.post("/create", json=body, headers={"X-Session-ID": sid})
            answers.append(client.get("/prompt", headers={"X-Session-ID": sid}))
            client.post("/delete", headers={"X-Session-ID": sid})
    assert [a.status_code for a in answers] == [422, 500]
    assert all("setup exploded" in a.json()["detail"] for a in answers)


def test_score_group_over_the_wire() -> None:
    server = Server([Slow])
    with server.serve_in_thread() as url:

        async def go() -> list[float]:
            env = ORSEnvironment(ORSOptions(url=url))
            session = await env.open({"n": 0})
            try:
                return await session.score_group(
                    [{"messages": [{"role": "assistant", "blocks": []}] * k} for k in (1, 3)]
                )
            finally:
                await session.close()
                await env.close()

        assert run(go()) == [1.0, 3.0]


def test_ors_is_a_registered_environment_with_checked_options() -> None:
    env = build(
        "env", "ors", options={"url": "http://127.0.0.1:9", "env_name": "Slow", "splits": ["train"]}
    )
    assert (
        isinstance(env, ORSEnvironment) and env.options.splits == ["train"] and env.name == "Slow"
    )
    with pytest.raises(ConfigError, match=r"env\.options\.ulr"):
        build("env", "ors", options={"ulr": "x"}, options_path="env.options")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_plait_env_serve_serves_an_environment(tmp_path: Path) -> None:
    (tmp_path / "served_env.py").write_text(
        "from plait_sdk import Environment, Split, TextBlock, ToolOutput, tool\n"
        "class Served(Environment):\n"
        "    @classmethod\n"
        "    def list_splits(cls): return ['train']\n"
        "    @classmethod\n"
        "    def list_tasks(cls, split): return [{'q': 'ping?'}]\n"
        "    def get_prompt(self): return [TextBlock(self.task_spec['q'])]\n"
        "    @tool\n"
        "    def reply(self, text: str) -> ToolOutput:\n"
        "        return ToolOutput(\n"
        "            blocks=[TextBlock('pong')], reward=float(text == 'ping'), finished=True\n"
        "        )\n"
    )
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "env",
            "serve",
            "served_env:Served",
            "--port",
            str(port),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read().decode()  # type: ignore[union-attr]
            try:
                httpx.get(f"{url}/health", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "plait env serve did not come up"
                time.sleep(0.1)

        async def go() -> Any:
            env = ORSEnvironment(ORSOptions(url=url))
            session = await env.open(await env.get_task("train", 0))
            try:
                return await session.call("reply", {"text": "ping"}), await session.call(
                    "reply", {"text": "ping"}
                )
            finally:
                await session.close()
                await env.close()

        first, second = run(go())
        assert isinstance(first, ToolOutput) and first.reward == 1.0
        assert isinstance(second, ToolError) and second.reason == "episode_finished"
    finally:
        process.terminate()
        process.wait(timeout=15)
