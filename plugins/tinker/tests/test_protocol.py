"""The wire rules an SDK relies on, by raw HTTP: long-polls end in 408, a request waits for its
run's earlier seq_ids and a resubmit gets the first request's id, failures are error bodies."""

from __future__ import annotations

import time

import httpx
import pytest

pytest.importorskip("tinker")


def _post(client: httpx.Client, path: str, body: dict, key: str) -> httpx.Response:
    return client.post(f"/api/v1/{path}", json=body, headers={"X-API-Key": key})


def _result(client: httpx.Client, request_id: str, key: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reply = _post(client, "retrieve_future", {"request_id": request_id}, key)
        if reply.status_code != 408:
            return reply.json()
    raise AssertionError(f"{request_id} did not finish")


def test_seq_order_resubmits_and_long_polls(
    tinker_url: str, base_model: str, api_keys: dict[str, str]
) -> None:
    key = api_keys["alice"]
    with httpx.Client(base_url=tinker_url, timeout=30) as client:
        session = _post(
            client, "create_session", {"tags": [], "sdk_version": "0.38.0"}, key
        ).json()["session_id"]
        created = _post(
            client,
            "create_model",
            {
                "session_id": session,
                "model_seq_id": 0,
                "base_model": base_model,
                "lora_config": {"rank": 2},
            },
            key,
        ).json()
        model_id = _result(client, created["request_id"], key)["model_id"]
        assert model_id == f"{session}:train:0" == created["model_id"]

        # seq 2 arrives first: it waits for seq 1, and the poll answers 408 meanwhile
        step = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
        second = _post(client, "optim_step", step, key).json()["request_id"]
        started = time.monotonic()
        assert _post(client, "retrieve_future", {"request_id": second}, key).status_code == 408
        assert time.monotonic() - started >= 1.5  # held for the server's poll_s (2 s here)
        assert _post(client, "optim_step", step, key).json()["request_id"] == second  # a resubmit
        first = _post(client, "optim_step", {**step, "seq_id": 1}, key).json()["request_id"]
        assert "metrics" in _result(client, first, key) and "metrics" in _result(
            client, second, key
        )

        failed = _post(
            client,
            "optim_step",
            {"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": -1.0}},
            key,
        )
        assert failed.status_code == 400 and failed.json()["category"] == "user"
        assert "learning_rate" in failed.json()["error"]
        assert (
            _post(
                client,
                "optim_step",
                {"model_id": "nope:train:0", "seq_id": 1, "adam_params": {}},
                key,
            ).status_code
            == 404
        )
        garbage = client.post(
            "/api/v1/forward_backward",
            content=b"\x01\x02",
            headers={"X-API-Key": key, "Content-Type": "application/x-protobuf"},
        )
        assert garbage.status_code == 400 and "ForwardBackwardRequest" in garbage.json()["error"]
        assert client.get("/api/v1/healthz").json() == {"status": "ok"}
        assert _post(client, f"sessions/{session}/finish", {}, key).status_code == 200
        assert _post(client, "create_session", {}, "tml-wrong").status_code == 401


def test_the_command_serves_the_example_and_refuses_other_hosts_without_tenants(tmp_path) -> None:
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[3] / "examples" / "tinker_tiny.toml"
    plait = [sys.executable, "-m", "plait.cli", "serve", "tinker", str(example)]
    refused = subprocess.run(
        [*plait, "-s", "server.host=0.0.0.0"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0 and "[[tenants]]" in refused.stderr
    bad = subprocess.run(
        [*plait, "-s", "trainer.engine=nope"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode != 0 and "trainer.engine" in bad.stderr, bad.stderr[-2000:]
    server = subprocess.Popen(
        [*plait, "-s", "server.port=0", "-s", f"server.storage={tmp_path}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        url = line.split(" on ", 1)[1].split()[0]
        with httpx.Client(base_url=url, timeout=30) as client:
            assert client.get("/api/v1/healthz").json() == {"status": "ok"}
            models = client.get(
                "/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-local"}
            ).json()
            assert [m["model_name"] for m in models["supported_models"]] == ["tiny-qwen3"]
    finally:
        server.terminate()
        server.wait(30)
