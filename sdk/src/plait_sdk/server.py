"""An Open Reward Standard (ORS) server for any plait environment (FastAPI + uvicorn, SSE).

    from plait_sdk import Server
    Server([MyEnv]).run()                    # loopback, port 8080

It serves SDK `Environment` classes and any object that implements the core
`plait.protocols.Environment` (so `plait env serve NAME` can serve every registered environment).
It follows the compatibility recipe of reference/ors.md: every endpoint of both official SDKs
(environment routes also answer without the `/{env}` prefix, for the default environment),
`/create_session` and `/call` always answer with well-formed SSE, result pieces never start with
whitespace, tool outputs always carry `metadata`/`reward`/`finished`, the `X-Secrets` header and
a body `secrets` are both accepted, and an empty `X-API-Key` is tolerated when no key is set.

Differences from the official servers, all on purpose:
- A malformed or out-of-order request gets a 4xx whose `detail` says what was wrong and how to fix
  it; never a 5xx, never a redirect (the official servers answer 500 or 308 in several such cases).
  A 5xx means the environment's own code failed (e.g. `setup()` on a task from its own split).
- Resume tokens (`task_id`) belong to the session that started the call; an unknown one is a 404.
- `/delete_session` also deletes the session if `/delete` was never called (no leak).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import importlib.metadata
import inspect
import ipaddress
import json
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import pydantic
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plait.errors import PlaitError
from plait.protocols import Environment as EnvironmentProtocol
from plait.protocols import EnvSession
from plait.types import Message, ToolSpec
from plait_sdk import sse
from plait_sdk.environment import Environment
from plait_sdk.local import LocalEnvironment
from plait_sdk.types import (
    block_to_wire,
    dumps,
    list_tools_to_wire,
    message_to_wire,
    run_tool_result_to_wire,
    split_to_wire,
)

log = structlog.get_logger("plait_sdk.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "Connection": "keep-alive", "X-Accel-Buffering": "no"}


@attrs.frozen
class ServerOptions:
    """How the server behaves; the defaults are those of the official servers."""

    api_key: str | None = None
    """When set, every request but /health must send it as X-API-Key (or Authorization: Bearer)."""
    session_ttl_s: float = 900.0
    """A session without any request (pings included) for this long is deleted."""
    reaper_interval_s: float = 5.0
    setup_wait_s: float = 25.0
    """How long /prompt, /messages, /task_tools and /call wait for setup before answering 503."""
    retry_after_s: int = 2
    ping_interval_s: float = 10.0
    """SSE keep-alive comment interval while a tool runs."""
    result_linger_s: float = 60.0
    """How long a finished call's result stays available for resuming."""
    max_body_bytes: int = 16 * 1024 * 1024
    max_sessions: int = 100_000


class RequestError(Exception):
    """A request the server refuses: a 4xx with a message that says what was wrong."""

    def __init__(self, status: int, detail: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = dict(headers or {})


# ---------------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------------


class _Body(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


class CreateBody(_Body):
    env_name: str | None = None
    task_spec: dict[str, Any] | None = None
    split: str | None = None
    index: pydantic.StrictInt | None = None
    secrets: dict[str, str] | None = None  # ors-sdk's server reads secrets from the body
    toolset_name: str | None = None  # openreward's platform toolsets; not supported here


class SplitBody(_Body):
    split: str


class TaskBody(_Body):
    split: str
    index: pydantic.StrictInt


class TaskRangeBody(_Body):
    split: str
    start: pydantic.StrictInt | None = None
    stop: pydantic.StrictInt | None = None


class ToolCallBody(_Body):
    name: str
    input: dict[str, Any] = pydantic.Field(default_factory=dict)
    task_id: str | None = None


class ScoreGroupBody(_Body):
    candidates: list[dict[str, Any]]
    task_id: str | None = None


def _validation_message(exc: pydantic.ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(body)"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# Session state
# ---------------------------------------------------------------------------------------------


@attrs.define(eq=False)
class _Call:
    """One tool call (or group scoring), kept apart from the HTTP stream so a dropped stream
    loses nothing: the client re-attaches with the call's task_id."""

    task_id: str
    task: asyncio.Task[str]
    done: asyncio.Event = attrs.field(factory=asyncio.Event)
    result: str | None = None
    error: str | None = None


@attrs.define(eq=False)
class _Session:
    sid: str
    env_name: str
    task_from_client: bool
    opening: asyncio.Task[EnvSession]
    last_seen: float
    calls: dict[str, _Call] = attrs.field(factory=dict)
    deleted: bool = False


@attrs.define(eq=False)
class _Served:
    name: str
    env: Any  # a core Environment
    shared_tools: tuple[list[ToolSpec], ToolSpec | None] | None = None


def _as_protocol_env(env: Any) -> Any:
    if inspect.isclass(env) and issubclass(env, Environment):
        return LocalEnvironment(env)
    if isinstance(env, Environment):
        return LocalEnvironment(type(env))
    if not isinstance(env, EnvironmentProtocol):
        raise TypeError(f"{env!r} is neither a plait_sdk.Environment subclass nor a plait environment "
                        "(plait.protocols.Environment)")
    return env


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """Serves environments over ORS. The first environment is the default one."""

    def __init__(self, environments: Sequence[Any], return_errors: str = "exception", *,
                 options: ServerOptions | None = None) -> None:
        if not environments:
            raise ValueError("Server needs at least one environment")
        self.options = options or ServerOptions()
        self.return_errors = return_errors
        self.envs: dict[str, _Served] = {}
        for env in environments:
            proto = _as_protocol_env(env)
            key = str(proto.name).lower()
            if key in self.envs:
                raise ValueError(f"two environments are named {key!r}; names must be unique (case-insensitive)")
            self.envs[key] = _Served(key, proto)
        self.default_env = next(iter(self.envs))
        self.sessions: dict[str, _Session] = {}
        self.reserved: dict[str, float] = {}  # sids handed out by /create_session
        self._reaper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.app = self._build_app()

    # -- session bookkeeping ---------------------------------------------------------------------

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.reaper_interval_s)
            await self.reap()

    async def reap(self) -> int:
        """Delete sessions idle for longer than the TTL; returns how many."""
        cutoff = time.monotonic() - self.options.session_ttl_s
        stale = [s for s in self.sessions.values() if s.last_seen < cutoff]
        for session in stale:
            log.info("session expired", sid=session.sid, idle_s=round(time.monotonic() - session.last_seen))
            await self._delete(session)
        for sid, created in list(self.reserved.items()):
            if created < cutoff:
                self.reserved.pop(sid, None)
        return len(stale)

    async def _delete(self, session: _Session) -> None:
        """Remove a session; its environment is closed as soon as it has finished opening."""
        if session.deleted:
            return
        session.deleted = True
        self.sessions.pop(session.sid, None)
        for call in session.calls.values():
            if not call.done.is_set():
                call.task.cancel()
        if session.opening.done():
            await _close_opened(session.opening)
        else:  # setup still runs (maybe in a thread that cannot be cancelled): close when it ends
            session.opening.add_done_callback(lambda t: self._spawn(_close_opened(t)))

    async def close_all(self) -> None:
        for session in list(self.sessions.values()):
            await self._delete(session)
        if self._reaper is not None:
            self._reaper.cancel()
        if self._background:
            await asyncio.wait(list(self._background), timeout=10)

    # -- request helpers -------------------------------------------------------------------------

    def _env(self, env_name: str | None) -> _Served:
        name = (self.default_env if env_name is None else env_name).lower()
        served = self.envs.get(name)
        if served is None:
            raise RequestError(404, f"unknown environment {env_name!r}; this server serves {sorted(self.envs)}")
        return served

    @staticmethod
    def _sid(request: Request) -> str:
        sid = request.headers.get("x-session-id", "").strip()
        if not sid:
            raise RequestError(400, "the X-Session-ID header is required for this endpoint "
                                    "(get a session id from POST /create_session)")
        if len(sid) > 256 or not sid.isprintable():
            raise RequestError(400, "X-Session-ID must be at most 256 printable characters")
        return sid

    def _session(self, request: Request, env_name: str | None = None) -> _Session:
        sid = self._sid(request)
        session = self.sessions.get(sid)
        if session is None:
            hint = ("POST /create has not been called for it yet" if sid in self.reserved
                    else "it was never created, was deleted, or expired after "
                         f"{self.options.session_ttl_s:g} s without requests")
            raise RequestError(404, f"no active session {sid!r}: {hint}")
        if env_name is not None and env_name.lower() != session.env_name:
            self._env(env_name)  # an unknown environment is a 404 of its own
            raise RequestError(400, f"session {sid!r} belongs to environment {session.env_name!r}, "
                                    f"not {env_name!r}")
        session.last_seen = time.monotonic()
        return session

    async def _ready(self, session: _Session) -> EnvSession:
        """The open environment session, waiting for setup up to `setup_wait_s`."""
        try:
            return await asyncio.wait_for(asyncio.shield(session.opening), self.options.setup_wait_s)
        except TimeoutError:
            raise RequestError(503, f"session {session.sid!r} is still running setup(); retry after "
                                    f"{self.options.retry_after_s} s",
                               {"Retry-After": str(self.options.retry_after_s),
                                "X-Backend-State": "starting"}) from None
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            if session.task_from_client:
                raise RequestError(422, f"the environment could not open the task_spec sent to /create: "
                                        f"{message}") from exc
            raise _EnvironmentFailure(f"environment setup failed: {message}") from exc

    async def _body(self, request: Request, model: type[_Body]) -> Any:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.options.max_body_bytes):
            raise RequestError(413, f"request body is larger than {self.options.max_body_bytes} bytes")
        raw = await request.body()
        if len(raw) > self.options.max_body_bytes:
            raise RequestError(413, f"request body is larger than {self.options.max_body_bytes} bytes")
        fields = ", ".join(model.model_fields)
        if not raw.strip():
            raise RequestError(422, f"{request.method} {request.url.path} needs a JSON object body "
                                    f"(fields: {fields})")
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(422, f"request body is not valid JSON ({exc}); send a JSON object "
                                    f"(fields: {fields})") from None
        if not isinstance(data, dict):
            raise RequestError(422, f"request body must be a JSON object (fields: {fields}), "
                                    f"got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except pydantic.ValidationError as exc:
            raise RequestError(422, f"invalid body for {request.method} {request.url.path}: "
                                    f"{_validation_message(exc)}") from None

    async def _check_split(self, served: _Served, split: str) -> None:
        names = [s.name for s in await served.env.splits()]
        if split not in names:
            raise RequestError(400, f"environment {served.name!r} has no split {split!r}; its splits are {names}")

    async def _num_tasks(self, served: _Served, split: str) -> int:
        await self._check_split(served, split)
        return int(await served.env.num_tasks(split))

    async def _task(self, served: _Served, split: str, index: int) -> dict[str, Any]:
        total = await self._num_tasks(served, split)
        if not 0 <= index < total:
            raise RequestError(400, f"task index {index} is out of range for split {split!r} "
                                    f"(it has {total} tasks: 0..{total - 1})")
        return dict(await served.env.get_task(split, index))

    async def _shared_tools(self, served: _Served) -> tuple[list[ToolSpec], ToolSpec | None]:
        if served.shared_tools is None:
            if hasattr(served.env, "shared_tools"):
                served.shared_tools = await served.env.shared_tools()
            else:  # a generic environment lists tools per session: ask one on its first task
                session = await served.env.open(await self._first_task(served))
                try:
                    served.shared_tools = (await session.tools(), await session.terminal_tool())
                finally:
                    await session.close()
        return served.shared_tools

    async def _first_task(self, served: _Served) -> dict[str, Any]:
        for split in await served.env.splits():
            if await served.env.num_tasks(split.name) > 0:
                return dict(await served.env.get_task(split.name, 0))
        raise RequestError(404, f"environment {served.name!r} has no tasks to list tools from")

    @staticmethod
    def _secrets(request: Request, body: CreateBody) -> dict[str, str]:
        secrets = dict(body.secrets or {})
        raw = request.headers.get("x-secrets", "").strip()
        if not raw:
            return secrets
        try:
            payload = json.loads(base64.b64decode(raw, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise RequestError(400, f"the X-Secrets header must be base64 of a JSON object ({exc})") from None
        if not isinstance(payload, dict):
            raise RequestError(400, "the X-Secrets header must encode a JSON object {NAME: {\"value\": ...}}")
        for key, value in payload.items():
            if isinstance(value, dict) and isinstance(value.get("value"), str):
                secrets[key] = value["value"]
            elif isinstance(value, str):
                secrets[key] = value
            else:
                raise RequestError(400, f"X-Secrets entry {key!r} must be a string or {{\"value\": str}}")
        return secrets

    def _stream(self, session: _Session, call: _Call) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            yield sse.event("task_id", call.task_id)
            while not call.done.is_set():
                try:
                    await asyncio.wait_for(asyncio.shield(call.done.wait()), self.options.ping_interval_s)
                except TimeoutError:
                    session.last_seen = time.monotonic()
                    yield sse.ping_comment()
            if call.error is not None:
                yield sse.event("error", call.error)
                return
            for piece in sse.result_events(call.result or ""):
                yield piece

        return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

    def _start_call(self, session: _Session, work: Callable[[], Any]) -> _Call:
        task_id = uuid.uuid4().hex

        async def run() -> str:
            return dumps(await work())

        call = _Call(task_id, asyncio.ensure_future(run()))

        def finish(task: asyncio.Task[str]) -> None:
            if task.cancelled():
                call.error = "the call was cancelled because its session was deleted"
            elif task.exception() is not None:
                exc = task.exception()
                call.error = f"{type(exc).__name__}: {exc}"
                log.warning("call failed", sid=session.sid, error=call.error)
            else:
                call.result = task.result()
            call.done.set()
            loop = asyncio.get_running_loop()
            loop.call_later(self.options.result_linger_s, session.calls.pop, task_id, None)

        call.task.add_done_callback(finish)
        session.calls[task_id] = call
        return call

    def _resume(self, session: _Session, task_id: str) -> _Call:
        call = session.calls.get(task_id)
        if call is None:
            raise RequestError(404, f"unknown task_id {task_id!r} for session {session.sid!r}: results are "
                                    f"kept {self.options.result_linger_s:g} s after a call ends; send the "
                                    "call again without task_id")
        return call

    # -- the app ---------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
            self._ensure_reaper()
            yield
            await self.close_all()

        app = FastAPI(title="plait ORS server", lifespan=lifespan, docs_url=None, redoc_url=None,
                      openapi_url=None)
        version = importlib.metadata.version("plait-sdk")

        app.add_middleware(_Guard, server=self)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            if exc.status_code == 404:
                detail = (f"no endpoint {request.method} {request.url.path}; ORS endpoints are /health, /version, "
                          "/list_environments, /create_session, /create, /ping, /delete, /delete_session and "
                          f"/{{env}}/(splits|tasks|num_tasks|task|task_range|tools|task_tools|prompt|messages|call|"
                          f"score_group); environments: {sorted(self.envs)}")
            elif exc.status_code == 405:
                detail = (f"{request.method} is not allowed on {request.url.path}; "
                          f"use {exc.headers.get('Allow', 'another method') if exc.headers else 'another method'}")
            else:
                detail = str(exc.detail)
            return JSONResponse({"detail": detail}, status_code=exc.status_code,
                                headers=dict(exc.headers or {}))

        @app.exception_handler(RequestError)
        async def request_error(_request: Request, exc: RequestError) -> JSONResponse:
            return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)

        @app.exception_handler(_EnvironmentFailure)
        async def environment_failure(_request: Request, exc: _EnvironmentFailure) -> JSONResponse:
            return JSONResponse({"detail": str(exc)}, status_code=500)

        @app.exception_handler(Exception)
        async def environment_bug(request: Request, exc: Exception) -> JSONResponse:
            # Only the environment's own code gets here: every request problem is a RequestError.
            log.error("environment code failed", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
            detail = (f"the environment failed: {type(exc).__name__}: {exc}" if self.return_errors != "none"
                      else "the environment failed")
            return JSONResponse({"detail": detail}, status_code=500)

        def env_route(method: str, suffix: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
            """Register a handler at /{env}/suffix and, for the default environment, at /suffix."""

            def register(handler: Callable[..., Any]) -> Callable[..., Any]:
                async def with_env(request: Request, env_name: str) -> Any:
                    return await handler(request, env_name)

                async def default_env(request: Request) -> Any:
                    return await handler(request, None)

                app.add_api_route(f"/{{env_name}}/{suffix}", with_env, methods=[method])
                app.add_api_route(f"/{suffix}", default_env, methods=[method])
                return handler

            return register

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/version")
        async def version_route() -> dict[str, Any]:
            return {"version": version, "build_sha": None, "server": "plait-sdk"}

        @app.get("/list_environments")
        async def list_environments() -> list[str]:
            return list(self.envs)

        @app.post("/create_session")
        async def create_session() -> StreamingResponse:
            if len(self.reserved) >= self.options.max_sessions:
                raise RequestError(429, "too many session ids are outstanding; delete unused ones with "
                                        "POST /delete_session", {"Retry-After": str(self.options.retry_after_s)})
            sid = str(uuid.uuid4())
            self.reserved[sid] = time.monotonic()

            async def events() -> AsyncIterator[bytes]:
                yield sse.event("task_id", sid)
                yield sse.event("end", "")

            return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)

        @app.post("/create")
        async def create(request: Request) -> dict[str, str]:
            sid = self._sid(request)
            body: CreateBody = await self._body(request, CreateBody)
            if sid in self.sessions:
                raise RequestError(409, f"session {sid!r} already exists; POST /delete it first or use a new id")
            if body.toolset_name is not None:
                raise RequestError(400, f"toolset_name {body.toolset_name!r} is not supported: this server "
                                        "has no platform toolsets; leave it out")
            has_spec = body.task_spec is not None
            has_index = body.split is not None or body.index is not None
            if has_spec == has_index:
                raise RequestError(422, "give exactly one of task_spec, or split and index together")
            if (body.split is None) != (body.index is None):
                raise RequestError(422, "split and index must be given together")
            served = self._env(body.env_name)
            task = (body.task_spec if body.task_spec is not None
                    else await self._task(served, body.split or "", body.index or 0))
            secrets = self._secrets(request, body)
            if len(self.sessions) >= self.options.max_sessions:
                raise RequestError(429, f"this server holds {len(self.sessions)} sessions, its limit; "
                                        "delete finished ones", {"Retry-After": str(self.options.retry_after_s)})
            opening = asyncio.ensure_future(served.env.open(task, secrets))
            opening.add_done_callback(_consume_exception)
            self.sessions[sid] = _Session(sid, served.name, has_spec, opening, time.monotonic())
            return {"sid": sid}

        @app.post("/ping")
        async def ping(request: Request) -> dict[str, str]:
            self._session(request)
            return {"status": "ok"}

        @app.post("/delete")
        async def delete(request: Request) -> dict[str, str]:
            session = self._session(request)
            await self._delete(session)
            return {"sid": session.sid}

        @app.post("/delete_session")
        async def delete_session(request: Request) -> dict[str, str]:
            sid = self._sid(request)
            known = self.reserved.pop(sid, None) is not None
            session = self.sessions.get(sid)
            if session is not None:
                await self._delete(session)
            elif not known:
                raise RequestError(404, f"no session id {sid!r}: it was never handed out by /create_session, "
                                        "or was already deleted")
            return {"sid": sid}

        @env_route("GET", "splits")
        async def splits(_request: Request, env_name: str | None) -> list[dict[str, str]]:
            return [split_to_wire(s) for s in await self._env(env_name).env.splits()]

        @env_route("POST", "tasks")
        async def tasks(request: Request, env_name: str | None) -> dict[str, Any]:
            served = self._env(env_name)
            body: SplitBody = await self._body(request, SplitBody)
            total = await self._num_tasks(served, body.split)
            return {"tasks": [dict(await served.env.get_task(body.split, i)) for i in range(total)],
                    "env_name": served.name}

        @env_route("POST", "num_tasks")
        async def num_tasks(request: Request, env_name: str | None) -> dict[str, int]:
            served = self._env(env_name)
            body: SplitBody = await self._body(request, SplitBody)
            return {"num_tasks": await self._num_tasks(served, body.split)}

        @env_route("POST", "task")
        async def task(request: Request, env_name: str | None) -> dict[str, Any]:
            served = self._env(env_name)
            body: TaskBody = await self._body(request, TaskBody)
            return {"task": await self._task(served, body.split, body.index), "env_name": served.name}

        @env_route("POST", "task_range")
        async def task_range(request: Request, env_name: str | None) -> dict[str, Any]:
            served = self._env(env_name)
            body: TaskRangeBody = await self._body(request, TaskRangeBody)
            total = await self._num_tasks(served, body.split)
            indices = range(*slice(body.start, body.stop).indices(total))
            return {"tasks": [dict(await served.env.get_task(body.split, i)) for i in indices],
                    "env_name": served.name}

        @env_route("GET", "tools")
        async def tools(_request: Request, env_name: str | None) -> dict[str, Any]:
            served = self._env(env_name)
            shared, terminal = await self._shared_tools(served)
            supports = getattr(served.env, "supports_score_group", lambda: False)()
            return list_tools_to_wire(shared, terminal, supports)

        @env_route("GET", "task_tools")
        async def task_tools(request: Request, env_name: str | None) -> dict[str, Any]:
            env_session = await self._ready(self._session(request, env_name))
            supports = getattr(env_session, "supports_score_group", lambda: False)()
            return list_tools_to_wire(await env_session.tools(), await env_session.terminal_tool(), supports)

        @env_route("GET", "prompt")
        async def prompt(request: Request, env_name: str | None) -> list[dict[str, Any]]:
            env_session = await self._ready(self._session(request, env_name))
            return [block_to_wire(b) for b in await env_session.prompt()]

        @env_route("GET", "messages")
        async def messages(request: Request, env_name: str | None) -> list[dict[str, Any]]:
            env_session = await self._ready(self._session(request, env_name))
            found: list[Message] = await env_session.messages()
            return [message_to_wire(m) for m in found]

        @env_route("POST", "call")
        async def call(request: Request, env_name: str | None) -> StreamingResponse:
            session = self._session(request, env_name)
            body: ToolCallBody = await self._body(request, ToolCallBody)
            if body.task_id is not None:
                return self._stream(session, self._resume(session, body.task_id))
            env_session = await self._ready(session)

            async def work() -> dict[str, Any]:
                return run_tool_result_to_wire(await env_session.call(body.name, body.input))

            return self._stream(session, self._start_call(session, work))

        @env_route("POST", "score_group")
        async def score_group(request: Request, env_name: str | None) -> StreamingResponse:
            session = self._session(request, env_name)
            body: ScoreGroupBody = await self._body(request, ScoreGroupBody)
            if body.task_id is not None:
                return self._stream(session, self._resume(session, body.task_id))
            env_session = await self._ready(session)
            if not getattr(env_session, "supports_score_group", lambda: False)():
                raise RequestError(404, f"environment {session.env_name!r} does not implement score_group")

            async def work() -> dict[str, Any]:
                scores = await env_session.score_group(body.candidates)  # type: ignore[attr-defined]
                if len(scores) != len(body.candidates):
                    raise ValueError(f"score_group returned {len(scores)} scores for "
                                     f"{len(body.candidates)} candidates")
                return {"scores": [{"reward": s, "metadata": None} for s in scores]}

            return self._stream(session, self._start_call(session, work))

        return app

    # -- running ---------------------------------------------------------------------------------

    def run(self, host: str = "127.0.0.1", port: int = 8080) -> None:
        """Serve until interrupted. Loopback by default; another host needs an API key."""
        import uvicorn

        self._check_host(host)
        log.info("serving", url=f"http://{host}:{port}", environments=list(self.envs))
        uvicorn.run(self.app, host=host, port=port, timeout_keep_alive=60, access_log=False, log_level="warning")

    def _check_host(self, host: str) -> None:
        if not is_loopback(host) and not self.options.api_key:
            raise PlaitError(f"refusing to serve on {host}, which is not a loopback address, without an API key",
                             fix="set an API key (plait env serve --api-key / ServerOptions(api_key=...)) "
                                 "or serve on 127.0.0.1")

    @contextlib.contextmanager
    def serve_in_thread(self, host: str = "127.0.0.1") -> Iterator[str]:
        """Serve on a free loopback port in a background thread; yields the base URL."""
        import uvicorn

        self._check_host(host)
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when the
        # listening socket says so, and without it each keep-alive request waits ~40 ms (delayed ACK).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False,
                                               timeout_keep_alive=60, lifespan="on"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                                  name=f"ors-server-{port}")
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the ORS server thread did not start")
            time.sleep(0.01)
        try:
            yield f"http://{host}:{port}"
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            sock.close()


class _Guard:
    """Plain ASGI middleware (no response buffering, so SSE streams pass straight through): starts
    the reaper on first use and checks the API key."""

    def __init__(self, app: Any, server: Server) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.server._ensure_reaper()
            key = self.server.options.api_key
            if key and scope["path"] != "/health" and not _key_matches(scope, key):
                response = JSONResponse({"detail": "missing or wrong API key: send it in the X-API-Key header"},
                                        status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _key_matches(scope: Any, key: str) -> bool:
    headers = {name.lower(): value for name, value in scope.get("headers", [])}
    sent = headers.get(b"x-api-key", b"")
    bearer = headers.get(b"authorization", b"")
    if not sent and bearer.lower().startswith(b"bearer "):
        sent = bearer[7:].strip()
    return hmac.compare_digest(sent, key.encode())


class _EnvironmentFailure(Exception):
    """The environment's own code failed (not the request): answered with a 500."""


def _consume_exception(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved here; reported to whoever waits on the session


async def _close_opened(opening: asyncio.Task[Any]) -> None:
    if opening.cancelled() or opening.exception() is not None:
        return
    try:
        await opening.result().close()
    except Exception as exc:  # EnvSession.close must not raise; a broken one is logged, not fatal
        log.warning("closing a session failed", error=f"{type(exc).__name__}: {exc}")
