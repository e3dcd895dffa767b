"""The Tinker SDK 0.38 wire protocol over HTTP (`/api/v1/...`), on `TinkerService`.

Futures: a submitted request answers `{"request_id"}` at once; `retrieve_future` holds the poll
for up to `server.poll_s` and answers 408 when the result is not ready (the SDK polls again
quietly), the result (protobuf for forward_backward and sample), or `{"error", "category"}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from plait_sdk.server import serving
from plait_tinker import wire
from plait_tinker.config import TinkerServerConfig, check_components
from plait_tinker.errors import ServiceError, error_body
from plait_tinker.service import Tenant, TinkerService, TrainingRunRecord

log = structlog.get_logger("plait_tinker")

PROTOBUF = "application/x-protobuf"
Handler = Callable[[Request, Tenant], Awaitable[Response]]


def _json(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status)


async def _body(request: Request) -> dict[str, Any]:
    try:
        data = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as exc:
        raise ServiceError(f"the body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ServiceError("the body must be a JSON object")
    return data


def _time(seconds: float | None) -> str | None:
    return (
        None
        if seconds is None
        else datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()
    )


class TinkerApp:
    def __init__(self, service: TinkerService) -> None:
        self.service = service
        routes = {
            "client/config": self.client_config,
            "client/dynamic_config": self.dynamic_config,
            "create_session": self.create_session,
            "session_heartbeat": self.heartbeat,
            "telemetry": self.telemetry,
            "create_model": self.create_model,
            "get_info": self.get_info,
            "forward_backward": self.forward_backward,
            "forward": self.forward_legacy,
            "optim_step": self.optim_step,
            "save_weights": self.save_weights,
            "save_weights_for_sampler": self.save_weights_for_sampler,
            "load_weights": self.load_weights,
            "create_sampling_session": self.create_sampling_session,
            "asample": self.asample,
            "retrieve_future": self.retrieve_future,
            "unload_model": self.unload_model,
        }
        self.asgi = Starlette(
            routes=[
                *(
                    Route(f"/api/v1/{path}", self._wrap(handler), methods=["POST"])
                    for path, handler in routes.items()
                ),
                Route(
                    "/api/v1/sessions/{session_id}/finish",
                    self._wrap(self.finish_session),
                    methods=["POST"],
                ),
                Route(
                    "/api/v1/samplers/{sampler_id:path}",
                    self._wrap(self.get_sampler),
                    methods=["GET"],
                ),
                Route("/api/v1/healthz", self._wrap(self.healthz, auth=False), methods=["GET"]),
                Route(
                    "/api/v1/get_server_capabilities",
                    self._wrap(self.capabilities),
                    methods=["GET"],
                ),
                Route("/api/v1/training_runs", self._wrap(self.training_runs), methods=["GET"]),
                Route(
                    "/api/v1/training_runs/{model_id}",
                    self._wrap(self.training_run),
                    methods=["GET"],
                ),
                Route(
                    "/api/v1/training_runs/{model_id}/checkpoints",
                    self._wrap(self.checkpoints),
                    methods=["GET"],
                ),
                Route(
                    "/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}",
                    self._wrap(self.delete_checkpoint),
                    methods=["DELETE"],
                ),
                Route(
                    "/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl",
                    self._wrap(self.set_ttl),
                    methods=["PUT"],
                ),
                Route(
                    "/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}/publish",
                    self._wrap(self.publish),
                    methods=["POST", "DELETE"],
                ),
                Route("/api/v1/checkpoints", self._wrap(self.all_checkpoints), methods=["GET"]),
                Route("/api/v1/weights_info", self._wrap(self.weights_info), methods=["POST"]),
                Route("/api/v1/sessions", self._wrap(self.list_sessions), methods=["GET"]),
                Route(
                    "/api/v1/sessions/{session_id}", self._wrap(self.get_session), methods=["GET"]
                ),
                Route(
                    "/api/v1/{rest:path}",
                    self._wrap(self.not_served),
                    methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
                ),
            ]
        )

    def _wrap(
        self, handler: Handler, auth: bool = True
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                tenant = self.service.tenant(request.headers.get("x-api-key")) if auth else None
                return await handler(request, tenant)  # type: ignore[arg-type]
            except Exception as exc:  # every failure is an error body, never a dropped connection
                status, body = error_body(exc)
                # retrying cannot help; the SDK's outer retry layer also ignores this header,
                # hence no 409 or 429 at submission (errors.quota_exceeded)
                return JSONResponse(body, status, headers={"x-should-retry": "false"})

        return endpoint

    # -- client, session -----------------------------------------------------------------------

    async def client_config(self, request: Request, tenant: Tenant) -> Response:
        # Plain httpx; no token exchange; the server orders forward_backward chunks by seq_id.
        return _json({"pjwt_auth_enabled": False, "use_pyqwest_transport": False})

    async def dynamic_config(self, request: Request, tenant: Tenant) -> Response:
        return _json({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    async def create_session(self, request: Request, tenant: Tenant) -> Response:
        await _body(request)
        return _json({"session_id": self.service.create_session(tenant), "type": "create_session"})

    async def heartbeat(self, request: Request, tenant: Tenant) -> Response:
        self.service.session(tenant, str((await _body(request)).get("session_id")))
        return _json({"type": "session_heartbeat"})

    async def finish_session(self, request: Request, tenant: Tenant) -> Response:
        await self.service.finish_session(tenant, request.path_params["session_id"])
        return _json({})

    async def telemetry(self, request: Request, tenant: Tenant) -> Response:
        return _json({"status": "accepted"})

    async def healthz(self, request: Request, tenant: Tenant | None) -> Response:
        return _json({"status": "ok"})

    async def capabilities(self, request: Request, tenant: Tenant) -> Response:
        return _json(
            {
                "supported_models": [
                    {
                        "model_name": name,
                        "max_context_length": spec.max_context_length,
                        "trainable": True,
                        "sampleable": True,
                    }
                    for name, spec in self.service.config.models.items()
                ]
            }
        )

    # -- training ------------------------------------------------------------------------------

    @staticmethod
    def _future(request_id: str, **extra: Any) -> Response:
        return _json({"request_id": request_id, **extra})

    async def create_model(self, request: Request, tenant: Tenant) -> Response:
        request_id, model_id = self.service.create_model(tenant, await _body(request))
        return self._future(request_id, model_id=model_id)

    async def get_info(self, request: Request, tenant: Tenant) -> Response:
        run = self.service.run(tenant, str((await _body(request)).get("model_id")))
        spec = self.service.config.models[run.base_model]
        return _json(
            {
                "type": "get_info",
                "model_id": run.model_id,
                "is_lora": True,
                "lora_rank": run.lora.rank,
                "model_data": {
                    "arch": None,
                    "model_name": run.base_model,
                    "tokenizer_id": spec.tokenizer or self.service.tokenizer_path(run.base_model),
                },
            }
        )

    async def forward_backward(self, request: Request, tenant: Tenant) -> Response:
        body = await request.body()
        if request.headers.get("content-encoding") == "zstd":
            raise ServiceError(
                "zstd-compressed bodies are not accepted; "
                "client/config leaves proto_compress_fwdbwd off"
            )
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise ServiceError(
                f"forward_backward takes a protobuf body ({PROTOBUF}), as tinker>=0.25 sends it"
            )
        call = wire.read_forward_backward(body)
        if request.query_params.get("forward_only") in ("true", "1"):
            call = attrs.evolve(call, forward_only=True)
        return self._future(self.service.forward_backward(tenant, call))

    async def forward_legacy(self, request: Request, tenant: Tenant) -> Response:
        raise ServiceError(
            "the JSON forward endpoint is gone since tinker 0.25; use an SDK >= 0.25", status=410
        )

    async def optim_step(self, request: Request, tenant: Tenant) -> Response:
        return self._future(self.service.optim_step(tenant, await _body(request)))

    async def save_weights(self, request: Request, tenant: Tenant) -> Response:
        return self._future(self.service.save_weights(tenant, await _body(request)))

    async def save_weights_for_sampler(self, request: Request, tenant: Tenant) -> Response:
        return self._future(self.service.save_weights_for_sampler(tenant, await _body(request)))

    async def load_weights(self, request: Request, tenant: Tenant) -> Response:
        request_id, model_id = self.service.load_weights(tenant, await _body(request))
        return self._future(request_id, **({"model_id": model_id} if model_id else {}))

    async def unload_model(self, request: Request, tenant: Tenant) -> Response:
        run = self.service.run(tenant, str((await _body(request)).get("model_id")))
        await self.service.unload(run)
        return self._future(
            self.service.futures.submit(
                tenant.name,
                run.session_id,
                _done({"type": "unload_model", "model_id": run.model_id}),
            )
        )

    # -- sampling ------------------------------------------------------------------------------

    async def create_sampling_session(self, request: Request, tenant: Tenant) -> Response:
        sampler_id = self.service.create_sampling_session(tenant, await _body(request))
        return _json({"sampling_session_id": sampler_id, "type": "create_sampling_session"})

    async def get_sampler(self, request: Request, tenant: Tenant) -> Response:
        sampler = self.service.sampler(tenant, request.path_params["sampler_id"])
        return _json(
            {
                "sampler_id": sampler.id,
                "base_model": sampler.base_model,
                "model_path": sampler.model_path,
            }
        )

    async def asample(self, request: Request, tenant: Tenant) -> Response:
        request_id, sequence_ids = self.service.sample(tenant, await _body(request))
        return self._future(request_id, sample_sequence_ids=sequence_ids)

    # -- futures -------------------------------------------------------------------------------

    async def retrieve_future(self, request: Request, tenant: Tenant) -> Response:
        request_id = str((await _body(request)).get("request_id"))
        pending = self.service.futures.pending(tenant.name, request_id)
        self.service.touch(pending.session)
        task = await self.service.futures.wait(
            pending, self.service.config.server.poll_s, _disconnected(request)
        )
        if task is None:
            return _json(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}, 408
            )
        if task.exception() is not None:
            return _json(error_body(task.exception())[1])  # type: ignore[arg-type]
        result = task.result()
        if isinstance(result, bytes):
            return Response(result, media_type=PROTOBUF)
        return _json(result)

    # -- REST ----------------------------------------------------------------------------------

    def _run_json(self, record: TrainingRunRecord) -> dict[str, Any]:
        data = record.data
        run = self.service.runs.get(data["model_id"])
        checkpoints = record.checkpoints()
        last = {
            kind: max(
                (c for c in checkpoints if c["checkpoint_type"] == kind),
                key=lambda c: c["time"],
                default=None,
            )
            for kind in ("training", "sampler")
        }
        return {
            "training_run_id": data["model_id"],
            "base_model": data["base_model"],
            "model_owner": data["tenant"],
            "is_lora": True,
            "lora_rank": data["lora"]["rank"],
            "corrupted": False,
            "last_request_time": _time(run.last_request if run else data["created"]),
            "last_checkpoint": _checkpoint_json(last["training"]),
            "last_sampler_checkpoint": _checkpoint_json(last["sampler"]),
            "user_metadata": data["user_metadata"] or None,
        }

    async def training_runs(self, request: Request, tenant: Tenant) -> Response:
        records = self.service.training_runs(tenant)
        offset, limit = _page(request)
        return _json(
            {
                "training_runs": [self._run_json(r) for r in records[offset : offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(records)},
            }
        )

    async def training_run(self, request: Request, tenant: Tenant) -> Response:
        return _json(self._run_json(self.service.record(tenant, request.path_params["model_id"])))

    async def checkpoints(self, request: Request, tenant: Tenant) -> Response:
        record = self.service.record(tenant, request.path_params["model_id"])
        return _json({"checkpoints": [_checkpoint_json(c) for c in record.checkpoints()]})

    async def all_checkpoints(self, request: Request, tenant: Tenant) -> Response:
        found = [c for r in self.service.training_runs(tenant) for c in r.checkpoints()]
        return _json(
            {
                "checkpoints": [_checkpoint_json(c) for c in found],
                "cursor": {"offset": 0, "limit": len(found), "total_count": len(found)},
            }
        )

    async def delete_checkpoint(self, request: Request, tenant: Tenant) -> Response:
        params = request.path_params
        await self.service.delete_checkpoint(
            tenant, params["model_id"], params["kind"], params["name"]
        )
        return _json({})

    async def set_ttl(self, request: Request, tenant: Tenant) -> Response:
        ttl = (await _body(request)).get("ttl_seconds")
        if ttl is not None and (not isinstance(ttl, int | float) or ttl <= 0):
            raise ServiceError(f"ttl_seconds must be a positive number or null, got {ttl!r}")
        params = request.path_params
        self.service.update_checkpoint(
            tenant,
            params["model_id"],
            params["kind"],
            params["name"],
            expires_at=None if ttl is None else time.time() + float(ttl),
        )
        return _json({})

    async def publish(self, request: Request, tenant: Tenant) -> Response:
        params = request.path_params
        self.service.update_checkpoint(
            tenant,
            params["model_id"],
            params["kind"],
            params["name"],
            public=request.method == "POST",
        )
        return _json({})

    async def weights_info(self, request: Request, tenant: Tenant) -> Response:
        record, _, _ = self.service.resolve_path(
            tenant, str((await _body(request)).get("tinker_path")), published=True
        )
        lora = record.data["lora"]
        return _json(
            {
                "base_model": record.data["base_model"],
                "is_lora": True,
                "lora_rank": lora["rank"],
                **{key: lora[key] for key in ("train_unembed", "train_mlp", "train_attn")},
            }
        )

    async def list_sessions(self, request: Request, tenant: Tenant) -> Response:
        offset, limit = _page(request)
        sessions = self.service.tenant_sessions(tenant)[offset : offset + limit]
        return _json({"sessions": [s.id for s in sessions]})

    async def get_session(self, request: Request, tenant: Tenant) -> Response:
        return _json(self.service.session_contents(tenant, request.path_params["session_id"]))

    async def not_served(self, request: Request, tenant: Tenant) -> Response:
        with contextlib.suppress(ServiceError, ValueError, TypeError):
            body = await _body(request)  # a training client's request holds a place in its order
            if body.get("seq_id") is not None:
                self.service.settle(tenant, str(body.get("model_id")), int(body["seq_id"]))
        raise ServiceError(
            f"{request.method} {request.url.path} is not served by plait: it is a hosted-Tinker "
            "feature (see the 'Not served' list in plait-tinker's README)",
            status=404,
        )

    # -- serving -------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serving(self, host: str, port: int) -> AsyncIterator[str]:
        """Serve in this event loop until the block ends; yields the base URL."""
        async with serving(self.asgi, host, port, "Tinker server") as url:
            reaper = asyncio.create_task(self._reap_sessions())
            try:
                yield url
            finally:
                reaper.cancel()
        await self.service.close()

    async def _reap_sessions(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.service.config.server.session_timeout_s / 4))
            await self.service.finish_stale_sessions()
            await self.service.expire_checkpoints()


def _page(request: Request) -> tuple[int, int]:
    """The `offset` and `limit` query parameters of a listing."""
    try:
        return int(request.query_params.get("offset", 0)), int(
            request.query_params.get("limit", 20)
        )
    except ValueError as exc:
        raise ServiceError(f"offset and limit must be integers: {exc}") from None


def _checkpoint_json(meta: dict[str, Any] | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    return {
        "checkpoint_id": meta["checkpoint_id"],
        "checkpoint_type": meta["checkpoint_type"],
        "time": _time(meta["time"]),
        "tinker_path": meta["tinker_path"],
        "expires_at": _time(meta["expires_at"]),
    }


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (its body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _done(value: Any) -> Any:
    return value


def build_app(config: TinkerServerConfig, storage: Path) -> TinkerApp:
    check_components(config)
    return TinkerApp(TinkerService(config, storage))
