"""Fixtures: a small fake OpenAI-compatible server (fast tests), and a real vLLM OpenAI server on
the tiny Qwen3 checkpoint (the `vllm`-marked contract test).

The real server runs from the vLLM venv that scripts/ci/vllm.sh builds: $PLAIT_VLLM_VENV, by
default .venvs/vllm in the repository. It is plain `vllm.entrypoints.openai.api_server`, with no
plait code inside: this plugin only needs what any OpenAI-compatible server offers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from plait.api import ResolvedModel
from plait_testing.venvs import venv_python

REPO = Path(__file__).resolve().parents[4]


def pytest_configure(config: pytest.Config) -> None:
    # The repository's pyproject.toml declares these; repeated here for a copy outside the
    # repository.
    config.addinivalue_line(
        "markers", "vllm: needs the vLLM venv (scripts/ci/vllm.sh or $PLAIT_VLLM_VENV)"
    )
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def unused_url() -> str:
    """The URL of a port nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


# -- the fake server ----------------------------------------------------------------------------


class FakeServer:
    """Speaks the part of vLLM's /v1/completions this engine uses. Token i of sample j is
    `(sum(prompt) + seed + j + i) % 100` with logprob -0.5, one token every `delay_s`; ids >= 100
    are out of the vocabulary (HTTP 400, as vLLM answers)."""

    def __init__(self, delay_s: float = 0.01) -> None:
        self.delay_s = delay_s
        self.requests: list[dict[str, Any]] = []
        self.active = 0  # streams being written right now
        self.disconnects = 0  # streams the client closed before the end
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends when the connection closes

            def log_message(self, *args: Any) -> None:
                pass

            def reply(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self.reply(
                        200,
                        {
                            "object": "list",
                            "data": [{"id": "fake-model", "object": "model", "max_model_len": 40}],
                        },
                    )
                else:
                    self.reply(404, {"detail": "Not Found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                prompt = body["prompt"]
                bad = [t for t in prompt if t >= 100]
                if bad:
                    self.reply(
                        400,
                        {
                            "error": {
                                "message": f"Token id {bad[0]} is out of vocabulary",
                                "code": 400,
                            }
                        },
                    )
                elif body.get("echo"):
                    tokens = [*prompt, 7]
                    self.reply(
                        200,
                        {
                            "choices": [
                                {
                                    "index": 0,
                                    "finish_reason": "length",
                                    "logprobs": {
                                        "tokens": [f"token_id:{t}" for t in tokens],
                                        "token_logprobs": [None] + [-0.1 * t for t in tokens[1:]],
                                    },
                                }
                            ]
                        },
                    )
                else:
                    self.stream(body)

            def stream(self, body: dict[str, Any]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                n, max_tokens, stops = (
                    body["n"],
                    body["max_tokens"] or 16,
                    body.get("stop_token_ids") or [],
                )
                base = sum(body["prompt"]) + body["seed"]
                live = set(range(n))
                fake.active += 1
                try:
                    for i in range(max_tokens):
                        time.sleep(fake.delay_s)
                        choices = []
                        for j in sorted(live):
                            token = (base + j + i) % 100
                            done = (
                                "stop"
                                if token in stops
                                else "length"
                                if i == max_tokens - 1
                                else None
                            )
                            choices.append(
                                {
                                    "index": j,
                                    "text": "",
                                    "finish_reason": done,
                                    "token_ids": [token],
                                    "logprobs": {
                                        "tokens": [f"token_id:{token}"],
                                        "token_logprobs": [-0.5],
                                    },
                                }
                            )
                            if done:
                                live.discard(j)
                        self.wfile.write(f"data: {json.dumps({'choices': choices})}\n\n".encode())
                        self.wfile.flush()
                        if not live:
                            break
                    self.wfile.write(b"data: [DONE]\n\n")
                except (BrokenPipeError, ConnectionResetError):
                    fake.disconnects += 1
                finally:
                    fake.active -= 1

        return Handler

    def __enter__(self) -> FakeServer:
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    with FakeServer() as server:
        yield server


# -- the real vLLM server -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return venv_python("PLAIT_VLLM_VENV", REPO / ".venvs" / "vllm", "scripts/ci/vllm.sh")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    from plait_testing.models import materialize_model

    return materialize_model("tiny-qwen3", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3")


@pytest.fixture(scope="module")  # stopped once the contract module is done
def vllm_url(
    vllm_python: str, tiny_model: ResolvedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A plain vLLM OpenAI server on tiny-qwen3, in float32 so that its logprobs match the float32
    reference trainer. Starting it takes a minute or more on two cores."""
    import httpx

    port = free_port()
    log_path = Path(tmp_path_factory.mktemp("vllm")) / "server.log"
    argv = [
        vllm_python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(tiny_model.path),
        "--tokenizer",
        str(tiny_model.tokenizer_path),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",  # room for the contract kit's long requests
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--seed",
        "0",
        "--enforce-eager",
    ]
    env = {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH"
    }  # nothing of this venv leaks in
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + float(os.environ.get("PLAIT_VLLM_STARTUP_S", "900"))
        while True:
            if server.poll() is not None:
                pytest.fail(
                    f"vLLM exited with code {server.returncode} while starting:\n"
                    + "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
                )
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not answer /health in time; see {log_path}")
            time.sleep(1)
        yield url
    finally:  # the whole process group: vLLM's engine core is a child process
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(5)
