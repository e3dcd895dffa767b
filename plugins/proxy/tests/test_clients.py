"""The proxy served over HTTP in front of the reference engine: the official SDKs' tool round
trips on every API (round_trips.py), sessions, models, cancellation, refusals, `plait serve
proxy`."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from plait_proxy.store import RolloutStore
from plait_proxy.testing import ROUND_TRIPS, Expected, serve_on_torch

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("plait_qwen", reason="needs the Qwen renderers (plait-qwen)")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", sorted(ROUND_TRIPS))
def test_a_tool_round_trip_through_each_api(
    tool_calling_qwen3: Any, api: str, stream: bool
) -> None:
    model, script = tool_calling_qwen3
    expected = Expected(script, ("calculator", {"expression": "7*6"}), reasoning="add them")
    serve_on_torch(model, lambda url, store: ROUND_TRIPS[api](url, store, api, expected, stream))


def test_sessions_come_from_the_path_the_header_or_the_api_key(tiny_qwen3: Any) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        body = {
            "model": "tool-model",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        }
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.post("/s/by-path/v1/chat/completions", json=body)).status_code == 200
            assert (
                await http.post(
                    "/v1/chat/completions", json=body, headers={"x-plait-session": "by-header"}
                )
            ).status_code == 200
            assert (
                await http.post("/v1/messages", json=body, headers={"x-api-key": "by-key"})
            ).status_code == 200
            missing = await http.post("/v1/chat/completions", json=body)
            assert missing.status_code == 400 and "session" in missing.json()["error"]["message"]
            assert sorted(store.sessions) == ["by-header", "by-key", "by-path"]
            assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == [
                "tool-model"
            ]
            finished = (await http.post("/sessions/by-path/finish")).json()
            assert (
                finished["calls"][0]["choices"][0]["token_ids"] and "by-path" not in store.sessions
            )

    serve_on_torch(tiny_qwen3, scenario)


def test_an_unknown_session_is_a_404_when_sessions_must_be_opened(tiny_qwen3: Any) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        async with openai.AsyncOpenAI(
            base_url=f"{url}/s/nobody/v1", api_key="key", max_retries=0
        ) as client:
            with pytest.raises(openai.NotFoundError, match="open it first"):
                await client.chat.completions.create(
                    model="tool-model", messages=[{"role": "user", "content": "hi"}]
                )
        assert not store.sessions

    serve_on_torch(tiny_qwen3, scenario, store_options={"auto_create": False})


def test_a_client_that_disconnects_cancels_its_sampling_and_records_nothing(
    tiny_qwen3: Any,
) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        body = {
            "model": "tool-model",
            "max_tokens": 3000,
            "temperature": 1.0,
            "messages": [{"role": "user", "content": "hi"}],
        }
        async with httpx.AsyncClient(base_url=url, timeout=1.0) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/s/gone/v1/chat/completions", json=body)
        for _ in range(100):
            if "gone" not in store.sessions:  # nothing recorded: the session it opened goes too
                break
            await asyncio.sleep(0.05)
        assert "gone" not in store.sessions

    serve_on_torch(tiny_qwen3, scenario)


@pytest.mark.slow  # a new process loads plait, torch and the model: a minute on a loaded machine
def test_plait_serve_proxy_serves_a_run_configs_model_and_stores_finished_sessions(
    tiny_qwen3: Any, tmp_path: Path
) -> None:
    import socket
    import subprocess
    import sys
    import time

    config = tmp_path / "proxy.toml"
    config.write_text(
        f'[model]\nname = "{tiny_qwen3.path}"\n[inference]\nengine = "torch"\n'
        '[renderer]\nname = "qwen3_keep_reasoning"\n'
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "plait.cli",
            "serve",
            "proxy",
            str(config),
            "--port",
            str(port),
            "--store",
            str(tmp_path / "store"),
            "--served-model-name",
            "any",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stdout.read().decode() if server.stdout else ""
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "plait serve proxy did not come up in 120 s"
                time.sleep(0.5)
        with openai.OpenAI(base_url=f"{url}/s/cli/v1", api_key="key") as client:
            answer = client.chat.completions.create(
                model="any",
                max_tokens=3,
                messages=[{"role": "user", "content": "hi"}],
                extra_body={"return_token_ids": True},
            )
        assert answer.model_extra and len(answer.choices[0].model_extra["token_ids"]) == 3
        unknown = httpx.post(
            f"{url}/s/cli/v1/chat/completions",
            json={"model": "other", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        record = httpx.post(f"{url}/sessions/cli/finish").json()
        stored = json.loads((tmp_path / "store" / "sessions.jsonl").read_text())
        assert (
            stored == record
            and stored["calls"][0]["choices"][0]["token_ids"]
            == answer.choices[0].model_extra["token_ids"]
        )
    finally:
        server.terminate()
        server.wait(30)


def test_a_prompt_past_the_engines_own_context_is_a_400_that_clients_do_not_retry(
    tiny_qwen3: Any,
) -> None:
    async def scenario(url: str, store: RolloutStore) -> None:
        body = {
            "model": "tool-model",
            "messages": [{"role": "user", "content": "hi " * 5000}],
        }  # past max_model_len 4096
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            response = await http.post("/s/long/v1/chat/completions", json=body)
        assert response.status_code == 400 and response.headers["x-should-retry"] == "false"
        assert "maximum context length" in response.json()["error"]["message"]

    serve_on_torch(tiny_qwen3, scenario)
