"""`plait serve inference` and the "remote" engine beyond the contract kit: what the service
refuses and how, its API key, and a service SIGKILLed under running requests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest

from plait.api import (
    INFERENCE_ENGINE,
    AdamParams,
    ConfigError,
    EngineError,
    ModelInput,
    ResolvedModel,
    SamplingParams,
    WeightUpdate,
)
from plait_testing.trainer import random_tokens, sft_datum, vocab_size


@pytest.mark.slow  # 6 s, a service process of its own: with the slow tests (make check < 5 min)
def test_a_connection_to_a_service_is_reused_after_a_training_steps_pause() -> None:
    """A step's sampling requests reuse the last step's connections: the service keeps them
    longer than uvicorn's 5 s, the remote engine's client longer than its default 1 s."""
    from plait_remote.options import RemoteOptions
    from plait_sdk.server import serving
    from plait_server.engine import EngineHTTP

    async def app(scope, receive, send) -> None:  # answers with the port the request came from
        body = str(scope["client"][1]).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def ports() -> list[str]:
        async with serving(app, "127.0.0.1", 0) as url:
            http = EngineHTTP(
                url, name="service", timeout_s=10, keepalive_s=RemoteOptions().keepalive_s
            )
            # POST, as sampling does (aiohttp sends a GET again by itself on a connection found
            # closed)
            seen = [(await http.request("POST", "/", json={})).text]
            await asyncio.sleep(5.5)
            seen.append((await http.request("POST", "/", json={})).text)
            await http.aclose()
            return seen

    first, second = asyncio.run(ports())
    assert first == second


def test_bad_requests_are_refused_with_what_was_wrong(
    service_url: str, tiny_model: ResolvedModel, tmp_path
) -> None:
    vocab = vocab_size(tiny_model)
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    with httpx.Client(base_url=service_url, timeout=60) as client:

        def refused(path: str, status: int = 400, **kwargs) -> dict:
            response = client.post(path, **kwargs)
            assert response.status_code == status, response.text
            return response.json()["error"]

        assert "not JSON" in refused("/sample", content=b"{nope")["message"]
        assert "lacks 'prompt'" in refused("/sample", json={"num_samples": 1})["message"]
        assert (
            "'prompt' is not valid"
            in refused("/sample", json={"prompt": 7, "num_samples": 1})["message"]
        )
        error = refused(
            "/sample",
            json={
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [vocab + 5]}]},
                "num_samples": 1,
            },
        )
        assert error["type"] == "DataError" and str(vocab + 5) in error["message"]
        assert "'mode' is not valid" in refused("/pause", json={"mode": "later"})["message"]
        assert (
            "no .safetensors"
            in refused("/load_weights", json={"path": str(tmp_path), "version": 3})["message"]
        )
        assert client.post("/nowhere", json={}).status_code == 404
        # none of it hurt the service
        reply = client.post(
            "/sample",
            json={
                "prompt": prompt,
                "num_samples": 2,
                "sampling_params": {"max_tokens": 3, "stop": []},
            },
        )
        assert reply.status_code == 200 and [
            len(s["tokens"]) for s in reply.json()["sequences"]
        ] == [3, 3]
        assert client.get("/health").json()["ok"] is True


@pytest.mark.slow  # 8 s, a service process of its own: with the slow tests (make check < 5 min)
def test_an_api_key_guards_everything_but_health(tiny_model: ResolvedModel, remote_options) -> None:
    from plait_remote.engine import RemoteEngine

    async def body() -> None:
        engine = RemoteEngine(tiny_model, options=remote_options(api_key="s3cret"), seed=0)
        try:
            reply = await engine.sample(
                ModelInput.from_ints([1, 2, 3]), 1, SamplingParams(max_tokens=2, stop=[])
            )
            assert len(reply.sequences[0].tokens) == 2
            async with httpx.AsyncClient(base_url=engine.base_url, timeout=30) as client:
                assert (await client.get("/health")).status_code == 200
                refused = await client.post("/sample", json={})
                assert (
                    refused.status_code == 401 and "API key" in refused.json()["error"]["message"]
                )
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 300))


def test_the_service_refuses_to_serve_itself_and_to_go_public_without_a_key(
    tiny_model: ResolvedModel, remote_options
) -> None:
    from plait_remote.engine import RemoteEngine
    from plait_remote.wire import component_factory

    with pytest.raises(EngineError, match="launch itself") as info:
        RemoteEngine(tiny_model, options=remote_options(engine="remote"))
    assert info.value.fix
    with pytest.raises(ConfigError, match="call itself"):
        component_factory(
            INFERENCE_ENGINE,
            None,
            (f"model.name={tiny_model.path}", "inference.engine=remote"),
        )
    done = subprocess.run(
        [sys.executable, "-m", "plait.cli", "serve", "inference", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PLAIT_API_KEY": ""},
    )
    assert done.returncode == 2 and "give an --api-key" in done.stderr


@pytest.mark.slow  # 21 s, killing and recovering: with the slow tests (make check < 5 min)
def test_a_service_killed_under_running_requests_is_launched_again_with_its_weights(
    tiny_model: ResolvedModel, remote_options
) -> None:
    """SIGKILL while requests are held in a pause: the engine launches the service again, loads
    the weights the dead one had, and sends the requests once more: the same tokens and the
    update's version. Greedy: a seeded sample of this random model's near-uniform distribution
    flips a token on the rounding of a batch of another size (as the re-sent requests may be)."""
    from plait.api import build
    from plait_remote.engine import RemoteEngine

    vocab = vocab_size(tiny_model)
    prompt = random_tokens(8, 10, vocab)
    params = SamplingParams(max_tokens=6, stop=[], temperature=0.0)
    trainer = build("trainer_engine", "torch", tiny_model, seed=0)
    target = (prompt[-1] + 5) % vocab
    for _ in range(2):
        trainer.forward_backward(
            [sft_datum([*prompt, target], [0.0] * (len(prompt) - 1) + [1.0])], "cross_entropy"
        )
        trainer.optim_step(AdamParams(learning_rate=5e-2))
    update = WeightUpdate(trainer.weight_version, dict(trainer.export_weights()))
    trainer.close()

    async def body() -> None:
        engine = RemoteEngine(tiny_model, options=remote_options(), seed=0)
        try:
            await engine.apply_weights(update)
            before = (await engine.sample(ModelInput.from_ints(prompt), 2, params)).sequences
            await engine.http.request("POST", "/pause", json={"mode": "keep"})
            running = [
                asyncio.ensure_future(engine.sample(ModelInput.from_ints(prompt), 2, params))
                for _ in range(2)
            ]
            await asyncio.sleep(1.0)  # the requests reach the service and are held there
            dead = engine.server.pid
            os.kill(dead, signal.SIGKILL)
            replies = await asyncio.gather(*running)
            assert (
                engine.restarts == 1
                and engine.server.pid != dead
                and engine.weight_version == update.version
            )
            for reply in replies:
                assert [s.tokens for s in reply.sequences] == [s.tokens for s in before]
                assert all(s.versions() == (update.version,) * 6 for s in reply.sequences)
            greedy = await engine.sample(
                ModelInput.from_ints(prompt),
                1,
                SamplingParams(max_tokens=1, stop=[], temperature=0),
            )
            assert greedy.sequences[0].tokens == (target,)
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 600))
