"""Regressions from the outside review of the ORS server and client (issue 17, items 1-6).

Each test drives the real server over loopback HTTP, as a hostile or careless client would.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter as Tally
from pathlib import Path
from typing import Any

import httpx
import pytest

from plait.api import get_registry
from plait_sdk import Environment, Server, Split, TextBlock, ToolOutput, tool
from plait_sdk.client import ORSEnvironment, ORSOptions
from plait_sdk.server import _send_json as send_json
from plait_sdk.types import INCLUDE_HEADER


class Counted(Environment):
    """Counts every instance built and torn down; `list_tasks` is sync, so /create by split and
    index waits on a worker thread (the window in which concurrent creates used to slip through)."""

    lock = threading.Lock()
    built = 0
    torn_down = 0

    def __init__(self, task_spec: Any = None, secrets: Any = None) -> None:
        super().__init__(task_spec, secrets)
        with Counted.lock:
            Counted.built += 1

    def teardown(self) -> None:
        with Counted.lock:
            Counted.torn_down += 1

    @classmethod
    def list_splits(cls) -> list[Split]:
        return [Split("train", "train")]

    @classmethod
    def list_tasks(cls, split: str) -> list[dict]:
        return [{"n": i} for i in range(3)]

    def get_prompt(self) -> list[TextBlock]:
        if self.task_spec.get("broken_prompt"):
            raise RuntimeError("get_prompt is broken on purpose")
        return [TextBlock(f"n={self.task_spec.get('n')}")]

    @tool
    def done(self) -> ToolOutput:
        return ToolOutput(blocks=[TextBlock("bye")], reward=1.0, finished=True)

    async def score_group(self, candidates: list[dict[str, Any]]) -> list[float]:
        return [0.0 for _ in candidates]


def sid_of(client: httpx.Client) -> str:
    return client.post("/create_session").text.split("event: task_id\ndata: ")[1].split("\n")[0]


def wait_until(condition: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- 1. concurrent /create with one X-Session-ID ---------------------------------------------------


def test_concurrent_creates_with_one_session_id_admit_exactly_one_and_leak_nothing() -> None:
    server = Server([Counted])
    built_before, torn_before = Counted.built, Counted.torn_down
    with server.serve_in_thread() as url:

        async def race(client: httpx.AsyncClient, sid: str, body: dict[str, Any]) -> list[int]:
            answers = await asyncio.gather(
                *(
                    client.post("/create", json=body, headers={"X-Session-ID": sid})
                    for _ in range(4)
                )
            )
            await client.post("/delete", headers={"X-Session-ID": sid})
            return sorted(a.status_code for a in answers)

        async def rounds() -> list[list[int]]:
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                return [
                    await race(
                        client,
                        f"race-{r}",
                        {"split": "train", "index": r % 3} if r % 2 else {"task_spec": {"n": r}},
                    )
                    for r in range(20)
                ]

        outcomes = asyncio.run(rounds())
        assert all(o == [200, 409, 409, 409] for o in outcomes), outcomes
        # every environment that was built is torn down once its session is deleted
        assert wait_until(
            lambda: Counted.built - built_before == Counted.torn_down - torn_before
        ), (Counted.built - built_before, Counted.torn_down - torn_before)
        assert not server.sessions
    assert Counted.built - built_before == 20


# -- 2. malformed JSON is a client error -----------------------------------------------------------

HUGE_INTEGER = b"9" * 5000
DEEP_ARRAY = b"[" * 100_000 + b"]" * 100_000


def body_endpoints(env: str) -> list[tuple[str, bool]]:
    """Every endpoint that reads a JSON body, and whether it needs an open session."""
    routes = [("/create", True)]
    for prefix in (f"/{env}", ""):
        routes += [
            (f"{prefix}/tasks", False),
            (f"{prefix}/num_tasks", False),
            (f"{prefix}/task", False),
            (f"{prefix}/task_range", False),
            (f"{prefix}/call", True),
            (f"{prefix}/score_group", True),
        ]
    return routes


@pytest.mark.parametrize(
    "body",
    [
        b'{"split": "train", "index": ' + HUGE_INTEGER + b"}",
        b'{"task_spec": {"n": '
        + HUGE_INTEGER
        + b'}, "name": "done", "input": {"k": -'
        + HUGE_INTEGER
        + b"}}",
        b'{"split": ' + DEEP_ARRAY + b"}",
        b'{"task_spec": {"deep": '
        + DEEP_ARRAY
        + b'}, "input": '
        + b'{"a":' * 50_000
        + b"1"
        + b"}" * 50_000
        + b"}",
        b'{"task_spec": {"deep": '
        + b"[" * 600
        + b"]" * 600
        + b"}}",  # parses, but nests beyond any sane task
        b'{"task_spec": {"x": NaN, "y": -Infinity}}',  # not JSON, although Python's parser takes it
        b'{"task_spec": {"x": 1e999}}',  # Python reads infinity
    ],
    ids=[
        "huge-integer",
        "huge-integers-in-objects",
        "deep-array",
        "deep-objects",
        "600-deep",
        "nan",
        "overflow",
    ],
)
def test_malformed_json_bodies_are_client_errors_on_every_endpoint(body: bytes) -> None:
    server = Server([Counted])
    with server.serve_in_thread() as url, httpx.Client(base_url=url, timeout=30) as client:
        sid = sid_of(client)
        assert (
            client.post(
                "/create", json={"task_spec": {"n": 0}}, headers={"X-Session-ID": sid}
            ).status_code
            == 200
        )
        for path, needs_session in body_endpoints("counted"):
            headers = {
                "X-Session-ID": sid if path != "/create" else "fresh",
                "Content-Type": "application/json",
            }
            answer = client.post(path, content=body, headers=headers if needs_session else {})
            assert answer.status_code in (400, 413, 422), (
                f"{path}: {answer.status_code} {answer.text[:300]}"
            )
            assert len(answer.json()["detail"]) > 10, f"{path}: {answer.text[:300]}"
        client.post("/delete", headers={"X-Session-ID": sid})
    assert not server.sessions


@pytest.mark.parametrize(
    "secrets",
    [
        b'{"KEY": {"value": ' + b"[" * 5000 + b"]" * 5000 + b"}}",
        b'{"KEY": ' + b"1" * 5000 + b"}",
        b'{"KEY": {"value": "v", "allowed_domains": ' + b"[" * 600 + b"]" * 600 + b"}}",
    ],
    ids=["deep", "huge-integer", "600-deep"],
)
def test_an_x_secrets_header_with_malformed_json_is_a_400(secrets: bytes) -> None:
    server = Server([Counted])
    with server.serve_in_thread() as url, httpx.Client(base_url=url, timeout=30) as client:
        answer = client.post(
            "/create",
            json={"task_spec": {"n": 0}},
            headers={"X-Session-ID": "s", "X-Secrets": base64.b64encode(secrets).decode()},
        )
    assert answer.status_code == 400, answer.text[:300]
    assert "X-Secrets" in answer.json()["detail"]
    assert not server.sessions


# -- 3. a 500 keeps the keep-alive connection usable -----------------------------------------------


def test_the_connection_survives_a_500_from_the_environment() -> None:
    server = Server([Counted])
    inner = server.app
    client_ports: list[int] = []

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            client_ports.append(scope["client"][1])
        await inner(scope, receive, send)

    server.app = recording
    with (
        server.serve_in_thread() as url,
        httpx.Client(base_url=url, timeout=10, limits=httpx.Limits(max_connections=1)) as client,
    ):
        sid = sid_of(client)
        client.post(
            "/create", json={"task_spec": {"broken_prompt": True}}, headers={"X-Session-ID": sid}
        )
        failed = client.get("/counted/prompt", headers={"X-Session-ID": sid})
        assert failed.status_code == 500 and "get_prompt is broken" in failed.json()["detail"]
        time.sleep(0.2)  # let a closing server's FIN arrive, as between a trainer's requests
        after = client.get("/counted/splits")
        client.post("/delete", headers={"X-Session-ID": sid})
    assert after.status_code == 200
    # the same connection carried the request after the 500: the server neither closed it
    # unannounced nor announced a close
    assert failed.headers.get("connection", "").lower() != "close"
    assert len(set(client_ports)) == 1, client_ports


def test_a_500_leaves_the_raw_connection_open_for_the_next_request() -> None:
    server = Server([Counted])
    with server.serve_in_thread() as url, httpx.Client(base_url=url) as client:
        sid = sid_of(client)
        client.post(
            "/create", json={"task_spec": {"broken_prompt": True}}, headers={"X-Session-ID": sid}
        )
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            request = (
                f"GET /counted/prompt HTTP/1.1\r\nHost: x\r\nX-Session-ID: {sid}\r\n\r\n"
                "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
            ).encode()
            sock.sendall(request)
            received = b""
            while b'{"status":"ok"}' not in received:
                data = sock.recv(65536)
                if not data:
                    break
                received += data
        client.post("/delete", headers={"X-Session-ID": sid})
    assert received.startswith(b"HTTP/1.1 500 ") and b'{"status":"ok"}' in received, received[:600]


# -- 4. no redirects -------------------------------------------------------------------------------


def test_a_trailing_slash_is_served_not_redirected() -> None:
    server = Server([Counted])
    with (
        server.serve_in_thread() as url,
        httpx.Client(base_url=url, follow_redirects=False) as client,
    ):
        plain = client.get("/counted/splits")
        for path in (
            "/counted/splits/",
            "/COUNTED/splits/",
            "/splits/",
            "/health/",
            "/list_environments/",
        ):
            answer = client.get(path)
            assert answer.status_code == 200, (
                path,
                answer.status_code,
                answer.headers.get("location"),
            )
        assert client.get("/counted/splits/").json() == plain.json()
        sid = sid_of(client)
        created = client.post(
            "/create/", json={"task_spec": {"n": 1}}, headers={"X-Session-ID": sid}
        )
        prompt = client.get("/counted/prompt/", headers={"X-Session-ID": sid})
        client.post("/delete/", headers={"X-Session-ID": sid})
    assert created.status_code == 200 and prompt.json()[0]["text"] == "n=1"
    assert not server.sessions


# -- 5. `plait env serve module:Class -o ...` ------------------------------------------------------


def test_serving_a_class_by_module_path_rejects_options(tmp_path: Path) -> None:
    (tmp_path / "served_env.py").write_text(
        "from plait_sdk import Environment, TextBlock, tool\n"
        "class Served(Environment):\n"
        "    @classmethod\n"
        "    def list_splits(cls): return ['train']\n"
        "    @classmethod\n"
        "    def list_tasks(cls, split): return [{'q': 'ping?'}]\n"
        "    def get_prompt(self): return [TextBlock(self.task_spec['q'])]\n"
        "    @tool\n"
        "    def reply(self, text: str) -> str: return 'pong'\n"
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    try:
        finished = subprocess.run(
            [
                sys.executable,
                "-m",
                "plait.cli",
                "env",
                "serve",
                "served_env:Served",
                "-o",
                "bogus=1",
                "--port",
                str(port),
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(tmp_path)},
        )
    except subprocess.TimeoutExpired:
        pytest.fail("plait env serve module:Class -o bogus=1 served instead of refusing the option")
    assert finished.returncode == 2, finished.stderr
    assert "bogus" in finished.stderr and "served_env:Served" in finished.stderr, finished.stderr


# -- 6. client noise -------------------------------------------------------------------------------


def test_client_requests_log_no_line_each_once_the_registry_configured_logging(
    caplog: pytest.LogCaptureFixture,
) -> None:
    get_registry()  # loads the plugins, which configures logging at INFO
    server = Server([Counted])
    with server.serve_in_thread() as url, caplog.at_level(logging.INFO):

        async def go() -> None:
            env = ORSEnvironment(ORSOptions(url=url))
            session = await env.open(await env.get_task("train", 0))
            await session.prompt()
            await session.close()
            await env.close()

        asyncio.run(go())
    noise = [r.getMessage() for r in caplog.records if r.getMessage().startswith("HTTP Request:")]
    assert not noise, noise[:3]


def test_the_client_remembers_that_a_server_has_no_messages_route() -> None:
    server = Server([Counted])
    inner = server.app
    requests: Tally[str] = Tally()

    async def without_messages(
        scope: Any, receive: Any, send: Any
    ) -> None:  # like an ors-sdk server
        if scope["type"] == "http":
            # nor the X-Plait-Include extension, which would answer these on /create
            scope = {
                **scope,
                "headers": [
                    (k, v) for k, v in scope["headers"] if k != INCLUDE_HEADER.lower().encode()
                ],
            }
            requests[scope["path"].rsplit("/", 1)[-1]] += 1
            if scope["path"].endswith(("/messages", "/task_tools")):
                await send_json(send, 404, b'{"detail":"Not Found"}')
                return
        await inner(scope, receive, send)

    server.app = without_messages
    with server.serve_in_thread() as url:

        async def go() -> list[str]:
            env = ORSEnvironment(ORSOptions(url=url))
            texts = []
            for n in range(3):
                session = await env.open({"n": n})
                texts.append((await session.messages())[0].content)
                await session.tools()
                await session.close()
            await env.close()
            return texts

        texts = asyncio.run(go())
    assert texts == ["n=0", "n=1", "n=2"]
    assert requests["messages"] == 1 and requests["task_tools"] == 1, requests
