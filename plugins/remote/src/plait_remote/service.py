"""`plait serve inference`: one inference engine in a process of its own, over HTTP.

Wire (JSON bodies; plait's types as `plait.serde` writes them):

- `GET /health` -> 200 `{"ok": true, "weight_version", "detail", "engine"}`, 503 with `ok` false.
- `POST /sample {"prompt": ModelInput, "num_samples", "sampling_params": SamplingParams}` -> `SampleResponse`.
- `POST /compute_logprobs {"prompt"}` -> `{"logprobs": [null, ...]}`.
- `POST /pause {"mode": "keep"|"abort"|"wait"}` (answers once the engine has paused), `POST /resume`.
- `POST /load_weights {"path", "version"}`: full weights as safetensors in directory `path` (the
  client stages them there; the disk is shared). An engine that loads from disk itself (vLLM,
  SGLang) is handed the path; any other gets the tensors.
- `POST /weight_version {"version"}`: the label alone (the weights came another way).

A request the service refuses is a 400 (`{"error": {"message", "fix", "type"}}`; the engine's
`DataError`s too), a missing or wrong key a 401, an engine failure a 500 with the engine's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from plait.errors import ConfigError, DataError, PlaitError
from plait.protocols import DiskWeightLoader, InferenceEngine
from plait.serde import from_json, to_json
from plait.types import ModelInput, SamplingParams, WeightUpdate

log = structlog.get_logger("plait_remote")

PAUSE_MODES = ("keep", "abort", "wait")


class BadRequest(Exception):
    """A request the service refuses (400)."""


def _reply(data: Any, status: int = 200) -> Response:
    # allow_nan: a logprob can be -inf (a token the model gives no mass), which JSON proper lacks
    return Response(json.dumps(data, allow_nan=True), status_code=status, media_type="application/json")


def _error(status: int, message: str, *, fix: str | None = None, kind: str | None = None) -> Response:
    return _reply({"error": {"message": message, "fix": fix, "type": kind}}, status)


def _field(body: dict[str, Any], name: str, parse: Callable[[Any], Any]) -> Any:
    if name not in body:
        raise BadRequest(f"the body lacks {name!r}")
    try:
        return parse(body[name])
    except Exception as exc:  # cattrs and the attrs validators raise many kinds
        raise BadRequest(f"{name!r} is not valid: {exc}") from None


def _mode(value: Any) -> str:
    if value not in PAUSE_MODES:
        raise ValueError(f"must be one of {', '.join(PAUSE_MODES)}, got {value!r}")
    return str(value)


def read_staged_weights(path: str | Path, version: int) -> WeightUpdate:
    """The full weights a client staged as safetensors files in directory `path`."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise BadRequest(f"{path} holds no .safetensors file (is the disk shared with the run?)")
    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return WeightUpdate(version=version, tensors=tensors)


class InferenceService:
    """The HTTP face of one `InferenceEngine` (see the module docstring for the wire)."""

    def __init__(self, engine: InferenceEngine, *, name: str, api_key: str | None = None) -> None:
        self.engine = engine
        self.name = name
        self.api_key = api_key
        self._weights_lock = asyncio.Lock()
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/sample", self._guarded(self.sample), methods=["POST"]),
            Route("/compute_logprobs", self._guarded(self.compute_logprobs), methods=["POST"]),
            Route("/pause", self._guarded(self.pause), methods=["POST"]),
            Route("/resume", self._guarded(self.resume), methods=["POST"]),
            Route("/load_weights", self._guarded(self.load_weights), methods=["POST"]),
            Route("/weight_version", self._guarded(self.weight_version), methods=["POST"]),
        ]
        self.app = Starlette(routes=routes)

    def _guarded(self, handler: Callable[[dict[str, Any]], Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            from plait_sdk.server import key_matches

            if self.api_key and not key_matches(request.headers, self.api_key):
                return _error(401, "missing or wrong API key", fix="send it as Authorization: Bearer <key> "
                              "(inference.options.api_key)")
            try:
                raw = await request.body()
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                return _reply(await handler(body))
            except json.JSONDecodeError as exc:
                return _error(400, f"the body is not JSON: {exc}")
            except BadRequest as exc:
                return _error(400, str(exc))
            except DataError as exc:
                return _error(400, exc.message, fix=exc.fix, kind="DataError")
            except PlaitError as exc:
                return _error(500, exc.message, fix=exc.fix, kind=type(exc).__name__)
            except Exception as exc:
                log.exception("the engine failed", path=request.url.path)
                return _error(500, f"the {self.name} engine failed: {type(exc).__name__}: {exc}")

        return endpoint

    async def health(self, request: Request) -> Response:
        health = await self.engine.health()
        body = {"ok": health.ok, "weight_version": health.weight_version, "detail": health.detail, "engine": self.name}
        return _reply(body, 200 if health.ok else 503)

    async def sample(self, body: dict[str, Any]) -> Any:
        prompt = _field(body, "prompt", lambda v: from_json(ModelInput, v))
        num_samples = _field(body, "num_samples", int)
        params = from_json(SamplingParams, body["sampling_params"]) if "sampling_params" in body else SamplingParams()
        return to_json(await self.engine.sample(prompt, num_samples, params))

    async def compute_logprobs(self, body: dict[str, Any]) -> Any:
        prompt = _field(body, "prompt", lambda v: from_json(ModelInput, v))
        return {"logprobs": await self.engine.compute_logprobs(prompt)}

    async def pause(self, body: dict[str, Any]) -> Any:
        await self.engine.pause(_field(body, "mode", _mode))
        return {"paused": True}

    async def resume(self, body: dict[str, Any]) -> Any:
        await self.engine.resume()
        return {"paused": False}

    async def load_weights(self, body: dict[str, Any]) -> Any:
        path = _field(body, "path", str)
        version = _field(body, "version", int)
        async with self._weights_lock:
            if isinstance(self.engine, DiskWeightLoader):
                await self.engine.load_weights_from_disk(path, version)
            else:
                update = await asyncio.to_thread(read_staged_weights, path, version)
                await self.engine.apply_weights(update)
        log.debug("weights loaded", path=path, version=version)
        return {"weight_version": self.engine.weight_version}

    async def weight_version(self, body: dict[str, Any]) -> Any:
        version = _field(body, "version", int)
        async with self._weights_lock:
            await self.engine.apply_weights(WeightUpdate(version=version, tensors={}))
        return {"weight_version": self.engine.weight_version}


def build_engine(config_path: Path | None, overrides: tuple[str, ...]) -> tuple[InferenceEngine, str]:
    """The inference engine of a run config (its model, inference section and seed)."""
    from plait import kinds
    from plait.components import resolve_model
    from plait.config import load_config
    from plait.plugins import get_registry

    config = load_config(config_path, overrides)
    name = config.inference.engine
    if name == "remote":
        raise ConfigError("inference.engine", "a service cannot serve the 'remote' engine (it would call itself)",
                          fix="name the engine the service runs, e.g. -s inference.engine=torch")
    factory = get_registry().get(kinds.INFERENCE_ENGINE, name)
    options = factory.validate_options(config.inference.options, "inference.options")
    model = resolve_model(config.model.name, tokenizer=config.model.tokenizer, dtype=config.model.dtype)
    return factory.load()(model, options=options, seed=config.run.seed), name


def serve_inference(config_path: Path | None, overrides: tuple[str, ...], *, host: str, port: int,
                    api_key: str | None) -> None:
    """Build the engine, then serve it until SIGINT or SIGTERM (the engine is closed on the way out)."""
    import click

    from plait.logs import configure
    from plait_sdk.server import is_loopback, serving

    if not api_key and not is_loopback(host):
        raise click.UsageError(f"--host {host} serves beyond this machine: give an --api-key first")
    configure("info")

    async def main() -> None:
        engine, name = build_engine(config_path, overrides)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            service = InferenceService(engine, name=name, api_key=api_key)
            async with serving(service.app, host, port, name="inference service") as url:
                click.echo(f"plait inference service ({name}) on {url}", err=True)
                await stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await engine.close()

    asyncio.run(main())
