"""`plait serve inference`: one inference engine in a process of its own, over HTTP.

Wire (JSON bodies; plait's types as `plait.serde` writes them; errors as in `plait_remote.wire`):

- `GET /health` -> 200 `{"ok": true, "weight_version", "detail", "engine"}`, 503 with `ok` false.
- `POST /sample {"prompt": ModelInput, "num_samples", "sampling_params": SamplingParams}`
  -> `SampleResponse`.
- `POST /compute_logprobs {"prompt"}` -> `{"logprobs": [null, ...]}`.
- `POST /pause {"mode": "keep"|"abort"|"wait"}` (answers once the engine has paused),
  `POST /resume`.
- `POST /load_weights {"path", "version"}`: full weights as safetensors in directory `path` (the
  client stages them there; the disk is shared). An engine that loads from disk itself (vLLM,
  SGLang) is handed the path; any other gets the tensors.
- `POST /weight_version {"version"}`: the label alone (the weights came another way).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from plait.api import InferenceEngine, ModelInput, SamplingParams, WeightUpdate, from_json, to_json
from plait_remote.wire import BadRequest, endpoint, field, log, reply
from plait_weights.capabilities import DiskWeightLoader

PAUSE_MODES = ("keep", "abort", "wait")


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
        self._weights_lock = asyncio.Lock()
        what = f"{name} inference engine"
        routes = [Route("/health", self.health, methods=["GET"])]
        for path, handler in [
            ("/sample", self.sample),
            ("/compute_logprobs", self.compute_logprobs),
            ("/pause", self.pause),
            ("/resume", self.resume),
            ("/load_weights", self.load_weights),
            ("/weight_version", self.weight_version),
        ]:
            routes.append(
                Route(path, endpoint(handler, name=what, api_key=api_key), methods=["POST"])
            )
        self.app = Starlette(routes=routes)

    async def health(self, request: Request) -> Response:
        health = await self.engine.health()
        body = {
            "ok": health.ok,
            "weight_version": health.weight_version,
            "detail": health.detail,
            "engine": self.name,
        }
        return reply(body, 200 if health.ok else 503)

    async def sample(self, body: dict[str, Any]) -> Any:
        prompt = field(body, "prompt", lambda v: from_json(ModelInput, v))
        num_samples = field(body, "num_samples", int)
        params = (
            field(body, "sampling_params", lambda v: from_json(SamplingParams, v))
            if "sampling_params" in body
            else SamplingParams()
        )
        return to_json(await self.engine.sample(prompt, num_samples, params))

    async def compute_logprobs(self, body: dict[str, Any]) -> Any:
        prompt = field(body, "prompt", lambda v: from_json(ModelInput, v))
        return {"logprobs": await self.engine.compute_logprobs(prompt)}

    async def pause(self, body: dict[str, Any]) -> Any:
        await self.engine.pause(field(body, "mode", _mode))
        return {"paused": True}

    async def resume(self, body: dict[str, Any]) -> Any:
        await self.engine.resume()
        return {"paused": False}

    async def load_weights(self, body: dict[str, Any]) -> Any:
        path = field(body, "path", str)
        version = field(body, "version", int)
        async with self._weights_lock:
            if isinstance(self.engine, DiskWeightLoader):
                await self.engine.load_weights_from_disk(path, version)
            else:
                update = await asyncio.to_thread(read_staged_weights, path, version)
                await self.engine.apply_weights(update)
        log.debug("weights loaded", path=path, version=version)
        return {"weight_version": self.engine.weight_version}

    async def weight_version(self, body: dict[str, Any]) -> Any:
        version = field(body, "version", int)
        async with self._weights_lock:
            await self.engine.apply_weights(WeightUpdate(version=version, tensors={}))
        return {"weight_version": self.engine.weight_version}


def serve_inference(
    config_path: Path | None,
    overrides: tuple[str, ...],
    *,
    host: str,
    port: int,
    api_key: str | None,
) -> None:
    """Build the config's inference engine, then serve it until SIGINT or SIGTERM."""
    from plait.api import INFERENCE_ENGINE
    from plait_remote.wire import component_factory, serve_until_stopped

    async def start() -> Any:
        make, name = component_factory(INFERENCE_ENGINE, config_path, overrides)
        engine = make()
        return (
            InferenceService(engine, name=name, api_key=api_key).app,
            "inference service",
            engine.close,
        )

    serve_until_stopped(start, host=host, port=port, api_key=api_key)
