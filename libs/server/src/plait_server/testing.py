"""Failure contract for inference engines that drive a server (`plait_server.engine.ServerEngine`).

Every failure must be a clear `EngineError` within the configured time, never a hang: a server
that cannot be reached, one that stops answering (a hung request or weight update), one without
an endpoint the engine needs (an older or differently configured version), a launch command that
dies at once, a server that crashes while in use, a closed engine. An engine plugin subclasses
`ServerEngineFailureContract` and provides:

    class TestMyEngineFailures(ServerEngineFailureContract):
        ready_routes = {"GET /model_info": {"weight_version": "default"}}   # what start-up reads

        @pytest.fixture
        def make_engine(self, model):     # (**options) -> engine; options as in its options class
            return lambda **options: MyEngine(model, options=MyOptions(**options), seed=0)

        @pytest.fixture
        def model(self, tmp_path):        # any ResolvedModel with a config.json
            ...

The servers these tests talk to are `ScriptedServer`s: real HTTP servers on loopback that answer
the routes they are given and never answer anything else.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from plait.api import (
    EngineError,
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    WeightUpdate,
)
from plait_server.engine import free_port


class ScriptedServer:
    """An HTTP/1.1 server on 127.0.0.1 that answers `routes` ("METHOD /path" -> JSON body, or
    (status, JSON body)) and leaves every other request unanswered (a hung server)."""

    def __init__(self, routes: Mapping[str, Any]) -> None:
        self.routes = dict(routes)
        self.port = free_port()
        self.requests: list[str] = []
        self._server: asyncio.AbstractServer | None = None
        self._hung: list[asyncio.StreamWriter] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> ScriptedServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for writer in self._hung:
            writer.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (h.partition(":") for h in lines[1:] if h)
                }
                await reader.readexactly(int(headers.get("content-length", "0")))
                route = f"{method} {target.split('?')[0]}"
                self.requests.append(route)
                if route not in self.routes:
                    self._hung.append(writer)
                    return
                reply = self.routes[route]
                status, body = reply if isinstance(reply, tuple) else (200, reply)
                payload = b"" if body is None else json.dumps(body).encode()
                writer.write(
                    f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


class ServerEngineFailureContract:
    ready_routes: dict[str, Any] = {}
    """Routes (besides GET /health) the engine reads when it first connects."""
    deadline_s: float = 0.5
    """The timeouts the tests configure; each failure must surface within a few times this."""

    @pytest.fixture
    def make_engine(self) -> Callable[..., Any]:
        raise NotImplementedError("provide make_engine(**options) -> engine")

    def routes(self, **extra: Any) -> dict[str, Any]:
        return {"GET /health": None, **self.ready_routes, **extra}

    def fast(self, **options: Any) -> dict[str, Any]:
        return {
            "control_timeout_s": self.deadline_s,
            "request_timeout_s": self.deadline_s,
            "startup_timeout_s": 30.0,
            **options,
        }

    def run(self, body: Callable[[], Any]) -> None:
        asyncio.run(asyncio.wait_for(body(), 60))

    def check_fast(self, started: float, limit: float = 10.0) -> None:
        assert time.monotonic() - started < limit, (
            "the failure was not reported within its deadline"
        )

    # -- attach ---------------------------------------------------------------------------

    def test_unreachable_server_is_a_clear_error(self, make_engine: Callable[..., Any]) -> None:
        async def body() -> None:
            engine = make_engine(**self.fast(url=f"http://127.0.0.1:{free_port()}"))
            started = time.monotonic()
            with pytest.raises(EngineError, match="cannot reach"):
                await engine.sample(ModelInput.from_ints([1, 2]), 1, SamplingParams(max_tokens=2))
            self.check_fast(started)
            health = await engine.health()
            assert not health.ok and "cannot reach" in health.detail
            await engine.close()

        self.run(body)

    def test_hung_server_times_out(self, make_engine: Callable[..., Any]) -> None:
        async def body() -> None:
            async with ScriptedServer(self.routes()) as server:
                engine = make_engine(**self.fast(url=server.url))
                started = time.monotonic()
                with pytest.raises(EngineError, match="did not answer"):
                    await engine.sample(
                        ModelInput.from_ints([1, 2]), 1, SamplingParams(max_tokens=2)
                    )
                with pytest.raises(EngineError, match="did not answer"):
                    await engine.compute_logprobs(ModelInput.from_ints([1, 2, 3]))
                self.check_fast(started)
                await engine.close()

        self.run(body)

    def test_hung_weight_update_times_out(
        self, make_engine: Callable[..., Any], tmp_path: Any
    ) -> None:
        async def body() -> None:
            async with ScriptedServer(self.routes()) as server:
                engine = make_engine(**self.fast(url=server.url))
                started = time.monotonic()
                with pytest.raises(EngineError, match="did not answer"):
                    await engine.load_weights_from_disk(str(tmp_path), 1)
                with pytest.raises(EngineError, match="did not answer"):
                    await engine.apply_weights(WeightUpdate(2, {}))
                self.check_fast(started)
                assert engine.weight_version == 0, "a failed update must not change the version"
                await engine.close()

        self.run(body)

    def test_missing_endpoint_is_named(self, make_engine: Callable[..., Any]) -> None:
        """A server version without an endpoint the engine needs: every route answers 404."""

        async def body() -> None:
            routes = {
                route: (404, {"detail": "Not Found"})
                for route in self.routes()
                if route != "GET /health"
            }
            async with ScriptedServer({"GET /health": None, **routes}) as server:
                engine = make_engine(**self.fast(url=server.url))
                with pytest.raises(EngineError, match="has no endpoint"):
                    await engine.sample(
                        ModelInput.from_ints([1, 2]), 1, SamplingParams(max_tokens=2)
                    )
                await engine.close()

        self.run(body)

    def test_unhealthy_server_is_reported(self, make_engine: Callable[..., Any]) -> None:
        async def body() -> None:
            async with ScriptedServer({"GET /health": (503, None)}) as server:
                engine = make_engine(**self.fast(url=server.url))
                with pytest.raises(EngineError, match="not healthy"):
                    await engine.sample(
                        ModelInput.from_ints([1, 2]), 1, SamplingParams(max_tokens=2)
                    )
                assert not (await engine.health()).ok
                await engine.close()

        self.run(body)

    # -- launch ---------------------------------------------------------------------------

    def test_launch_that_dies_reports_its_log(
        self, make_engine: Callable[..., Any], tmp_path: Any
    ) -> None:
        """A server command that exits at once (here: this interpreter without the server's
        package): the error names the exit code and shows the log, well before the start-up
        timeout."""

        async def body() -> None:
            engine = make_engine(
                **self.fast(
                    python=sys.executable,
                    log_path=str(tmp_path / "server.log"),
                    startup_timeout_s=120.0,
                    **self.dying_launch_options(),
                )
            )
            started = time.monotonic()
            with pytest.raises(
                EngineError, match=r"exited with code \d+ while starting"
            ) as failure:
                await engine.sample(ModelInput.from_ints([1, 2]), 1, SamplingParams(max_tokens=2))
            assert "No module named" in str(failure.value), (
                "the log's last lines belong in the error"
            )
            self.check_fast(started, limit=60.0)
            assert not (await engine.health()).ok
            await engine.close()

        self.run(body)

    def dying_launch_options(self) -> dict[str, Any]:
        """Options under which the launched command fails at once (default: the interpreter
        lacks the server package)."""
        return {}

    def test_closed_engine_refuses_requests(self, make_engine: Callable[..., Any]) -> None:
        async def body() -> None:
            async with ScriptedServer(self.routes()) as server:
                engine = make_engine(**self.fast(url=server.url))
                await engine.close()
                await engine.close()  # twice is fine
                with pytest.raises(EngineError, match="closed"):
                    await engine.sample(
                        ModelInput.from_ints([1, 2]), 1, SamplingParams(max_tokens=2)
                    )
                assert not (await engine.health()).ok

        self.run(body)


def assert_resampled_as_before(
    replies: Sequence[SampleResponse], before: Sequence[SampledSequence], version: int, atol: float
) -> None:
    """Requests re-issued on a restarted server sample what the dead one did (same seeds and
    weights), every token tagged with the restored weight version."""
    for reply in replies:
        assert [s.tokens for s in reply.sequences] == [s.tokens for s in before]
        for seq, ref in zip(reply.sequences, before, strict=True):
            np.testing.assert_allclose(seq.logprobs, ref.logprobs, atol=atol)
            assert seq.versions() == (version,) * len(seq.tokens)
