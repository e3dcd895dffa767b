"""`plait serve trainer`: trainer engines in a process of their own, over HTTP, Tinker-shaped: a
client creates a trainer (a fresh engine on the config's model, its own weights and optimizer
state), then drives it by id.

Wire (JSON bodies; plait's types as `plait.serde` writes them; errors as in `plait_remote.wire`):

- `GET /health` -> `{"ok": true, "engine", "trainers": n}`.
- `POST /trainers {}` -> `{"id", "weight_version", "capabilities": TrainerCapabilities,
  "peak_flops_per_s"}`.
- `POST /trainers/{id}/forward` and
  `/forward_backward {"data": [Datum], "loss_fn", "loss_fn_config"}` -> `ForwardBackwardOutput`.
- `POST /trainers/{id}/optim_step {"adam_params": AdamParams}` -> `OptimStepResult`.
- `POST /trainers/{id}/save_state` and `/load_state {"path"}`: a directory on the shared disk.
- `POST /trainers/{id}/export_weights {"path"}`: the weights as `path/model.safetensors`
  (Hugging Face names) -> `{"path", "weight_version"}`.
- `DELETE /trainers/{id}`: close it.

Each trainer runs its calls one at a time on a worker thread of its own (trainer engines are
synchronous).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from plait.api import AdamParams, Datum, MeasuresFlops, TrainerEngine, from_json, to_json
from plait_remote.wire import BadRequest, NotFound, endpoint, field, reply

log = structlog.get_logger("plait_remote")


def _data(value: Any) -> list[Datum]:
    if not isinstance(value, list):
        raise ValueError("must be a list of datums")
    return [from_json(Datum, item) for item in value]


def _loss_config(body: Mapping[str, Any]) -> dict[str, float] | None:
    config = body.get("loss_fn_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise BadRequest("'loss_fn_config' must be an object of numbers")
    return {str(k): float(v) for k, v in config.items()}


class _Hosted:
    """A trainer and the one worker thread that runs its calls, in order (torch keeps per-thread
    state, and a trainer takes one call at a time)."""

    def __init__(self) -> None:
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trainer")
        self.engine: TrainerEngine

    async def call(self, method: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self.worker, functools.partial(method, *args)
        )


class TrainerService:
    """Trainer engines made by `make_trainer`, served by id (see the module docstring)."""

    def __init__(
        self, make_trainer: Callable[[], TrainerEngine], *, name: str, api_key: str | None = None
    ) -> None:
        self.make_trainer = make_trainer
        self.name = name
        self.trainers: dict[str, _Hosted] = {}
        self._ids = itertools.count(1)
        what = f"{name} trainer engine"

        def post(path: str, handler: Callable[..., Any]) -> Route:
            return Route(path, endpoint(handler, name=what, api_key=api_key), methods=["POST"])

        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                post("/trainers", self.create),
                post("/trainers/{trainer_id}/forward", self.forward),
                post("/trainers/{trainer_id}/forward_backward", self.forward_backward),
                post("/trainers/{trainer_id}/optim_step", self.optim_step),
                post("/trainers/{trainer_id}/save_state", self.save_state),
                post("/trainers/{trainer_id}/load_state", self.load_state),
                post("/trainers/{trainer_id}/export_weights", self.export_weights),
                Route(
                    "/trainers/{trainer_id}",
                    endpoint(self.delete, name=what, api_key=api_key),
                    methods=["DELETE"],
                ),
            ]
        )

    async def health(self, request: Request) -> Response:
        return reply({"ok": True, "engine": self.name, "trainers": len(self.trainers)})

    def _hosted(self, trainer_id: str) -> _Hosted:
        hosted = self.trainers.get(trainer_id)
        if hosted is None:
            raise NotFound(
                f"no trainer {trainer_id!r} on this service (deleted, or the service restarted)"
            )
        return hosted

    async def create(self, body: dict[str, Any]) -> Any:
        hosted = _Hosted()
        try:
            hosted.engine = engine = await hosted.call(self.make_trainer)
        except BaseException:
            hosted.worker.shutdown(wait=False)
            raise
        trainer_id = f"t{next(self._ids)}"
        self.trainers[trainer_id] = hosted
        log.info("trainer created", trainer=trainer_id, engine=self.name)
        return {
            "id": trainer_id,
            "weight_version": engine.weight_version,
            "capabilities": to_json(engine.capabilities),
            "peak_flops_per_s": engine.peak_flops_per_s
            if isinstance(engine, MeasuresFlops)
            else None,
        }

    async def _losses(self, trainer_id: str, body: dict[str, Any], backward: bool) -> Any:
        hosted = self._hosted(trainer_id)
        data = field(body, "data", _data)
        loss_fn = field(body, "loss_fn", str)
        method = hosted.engine.forward_backward if backward else hosted.engine.forward
        return to_json(await hosted.call(method, data, loss_fn, _loss_config(body)))

    async def forward(self, body: dict[str, Any], trainer_id: str) -> Any:
        return await self._losses(trainer_id, body, backward=False)

    async def forward_backward(self, body: dict[str, Any], trainer_id: str) -> Any:
        return await self._losses(trainer_id, body, backward=True)

    async def optim_step(self, body: dict[str, Any], trainer_id: str) -> Any:
        hosted = self._hosted(trainer_id)
        params = field(body, "adam_params", lambda v: from_json(AdamParams, v))
        return to_json(await hosted.call(hosted.engine.optim_step, params))

    async def save_state(self, body: dict[str, Any], trainer_id: str) -> Any:
        hosted = self._hosted(trainer_id)
        await hosted.call(hosted.engine.save_state, field(body, "path", str))
        return {"weight_version": hosted.engine.weight_version}

    async def load_state(self, body: dict[str, Any], trainer_id: str) -> Any:
        hosted = self._hosted(trainer_id)
        await hosted.call(hosted.engine.load_state, field(body, "path", str))
        return {"weight_version": hosted.engine.weight_version}

    async def export_weights(self, body: dict[str, Any], trainer_id: str) -> Any:
        hosted = self._hosted(trainer_id)
        path = Path(field(body, "path", str))

        def write() -> Path:
            from plait_weights.sync import WEIGHTS_FILE, save_safetensors

            return save_safetensors(dict(hosted.engine.export_weights()), path) / WEIGHTS_FILE

        written = await hosted.call(write)
        return {"path": str(written), "weight_version": hosted.engine.weight_version}

    async def delete(self, body: dict[str, Any], trainer_id: str) -> Any:
        hosted = self.trainers.pop(trainer_id, None)
        if hosted is not None:
            try:
                await hosted.call(hosted.engine.close)
            finally:
                hosted.worker.shutdown(wait=False)
            log.info("trainer closed", trainer=trainer_id)
        return {"deleted": hosted is not None}

    async def close(self) -> None:
        for trainer_id in list(self.trainers):
            await self.delete({}, trainer_id)


def serve_trainer(
    config_path: Path | None,
    overrides: tuple[str, ...],
    *,
    host: str,
    port: int,
    api_key: str | None,
) -> None:
    """Serve trainer engines of the config's `[trainer]` kind until SIGINT or SIGTERM."""
    from plait.api import TRAINER_ENGINE
    from plait_remote.wire import component_factory, serve_until_stopped

    async def start() -> Any:
        make, name = component_factory(TRAINER_ENGINE, config_path, overrides)
        service = TrainerService(make, name=name, api_key=api_key)
        return service.app, "trainer service", service.close

    serve_until_stopped(start, host=host, port=port, api_key=api_key)
