"""An Open Reward Standard (ORS) server for any plait environment (a plain ASGI app on uvicorn,
SSE).

    from plait_sdk import Server
    Server([MyEnv]).run()                    # loopback, port 8080

It serves SDK `Environment` classes and any object that implements the core
`plait.protocols.Environment` (so `plait env serve NAME` can serve every registered environment).
It is compatible with both official SDKs (ors-sdk, openreward): every endpoint of both official SDKs
(environment routes also answer without the `/{env}` prefix, for the default environment),
`/create_session` and `/call` always answer with well-formed SSE, result pieces never start with
whitespace, tool outputs always carry `metadata`/`reward`/`finished`, the `X-Secrets` header and
a body `secrets` are both accepted, and an empty `X-API-Key` is tolerated when no key is set.

Differences from the official servers, all on purpose:
- A malformed or out-of-order request gets a 4xx whose `detail` says what was wrong and how to fix
  it; never a 5xx, never a redirect (the official servers answer 500 or 308 in several such cases).
  A 5xx means the environment's own code failed (e.g. `setup()` on a task from its own split).
  Malformed JSON includes integers past Python's 4300-digit limit, NaN/Infinity and nesting
  deeper than `ServerOptions.max_json_depth`. Every answer, a 5xx too, leaves the keep-alive
  connection open, and a path with a trailing slash is served like the path without it.
- Of concurrent `/create` requests with one session id exactly one wins; the others get 409.
- Resume tokens (`task_id`) belong to the session that started the call; an unknown one is a 404.
- `/delete_session` also deletes the session if `/delete` was never called (no leak).

One extension, which plain clients never see: a `/create` with `X-Plait-Include: messages,
task_tools` waits for the session's setup (up to `setup_wait_s`) and adds what `GET /messages` and
`GET /task_tools` would answer to its JSON (`"messages"`, `"task_tools"`), saving an episode two
round trips. What setup could not give in time, or failed to give, is left out, and the client
asks the route itself (and hears why there).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import importlib.metadata
import inspect
import ipaddress
import json
import math
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import click
import pydantic
import structlog

from plait.api import Environment as EnvironmentProtocol, EnvSession, Message, PlaitError, ToolSpec
from plait_sdk import sse
from plait_sdk.environment import Environment
from plait_sdk.local import LocalEnvironment
from plait_sdk.types import (
    INCLUDABLE,
    INCLUDE_HEADER,
    block_to_wire,
    dumps,
    list_tools_to_wire,
    message_to_wire,
    run_tool_result_to_wire,
    split_to_wire,
)

log = structlog.get_logger("plait_sdk.server")

KEEP_ALIVE_S = 60
"""How long plait's servers keep an idle connection: longer than a training step, so that the
next step's requests reuse it."""
SSE_HEADERS = {"Cache-Control": "no-cache", "Connection": "keep-alive", "X-Accel-Buffering": "no"}
ENDPOINTS = (
    "/health, /version, /list_environments, /create_session, /create, /ping, /delete, "
    "/delete_session and /{env}/(splits|tasks|num_tasks|task|task_range|tools|task_tools|prompt|"
    "messages|call|score_group)"
)


@attrs.frozen
class ServerOptions:
    """How the server behaves; the defaults are those of the official servers."""

    api_key: str | None = None
    """When set, every request but /health must send it as X-API-Key (or Authorization: Bearer)."""
    session_ttl_s: float = attrs.field(default=900.0, validator=attrs.validators.gt(0))
    """A session without any request (pings included) for this long is deleted. It counts from
    the end of the last request or call: a session is never deleted while a request or a tool
    call on it runs, however long, so any positive TTL is safe however seldom anything pings."""
    reaper_interval_s: float = 5.0
    setup_wait_s: float = 25.0
    """How long /prompt, /messages, /task_tools and /call wait for setup before answering 503 (and
    /create with X-Plait-Include before answering without the includes)."""
    retry_after_s: int = 2
    ping_interval_s: float = 10.0
    """SSE keep-alive comment interval while a tool runs."""
    result_linger_s: float = 60.0
    """How long a finished call's result stays available for resuming."""
    max_body_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 100
    """Request bodies and X-Secrets nesting deeper are refused: values that deep would run the
    server's or the environment's recursive code (copies, validation, encoding) out of stack."""
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


def parse_json(raw: bytes | str, max_depth: int) -> Any:
    """Standard JSON only, or a ValueError that says what is wrong: no NaN/Infinity (also none
    by overflow, as in 1e999), no integer too long to convert (Python's 4300-digit limit),
    nothing nested deeper than `max_depth`."""
    try:
        data = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError(f"it nests deeper than {max_depth} levels") from None
    # ValueError covers JSONDecodeError, UnicodeDecodeError and the integer-length limit
    if _nests_deeper_than(raw, data, max_depth):
        raise ValueError(f"it nests deeper than {max_depth} levels")
    return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: Python would read infinity, which no JSON can carry back
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _nests_deeper_than(raw: bytes | str, data: Any, max_depth: int) -> bool:
    brackets = (
        raw.count(b"[") + raw.count(b"{")
        if isinstance(raw, bytes)
        else raw.count("[") + raw.count("{")
    )
    if brackets <= max_depth:
        return False  # the usual small body: too few brackets to nest that deep, no walk needed
    stack: list[tuple[Any, int]] = [(data, 1)] if isinstance(data, dict | list) else []
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            return True
        for child in value.values() if isinstance(value, dict) else value:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


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

    def error(self) -> str | None:
        """Why the finished call has no result (None when it has one)."""
        if self.task.cancelled():
            return "the call was cancelled because its session was deleted"
        exc = self.task.exception()
        return None if exc is None else f"{type(exc).__name__}: {exc}"


@attrs.define(eq=False)
class _Session:
    sid: str
    env_name: str
    task_from_client: bool
    opening: asyncio.Task[EnvSession]
    last_seen: float
    calls: dict[str, _Call] = attrs.field(factory=dict)
    deleted: bool = False
    in_use: int = 0
    """Requests and calls running on the session; it never expires while there are any."""

    def hold(self) -> None:
        """Keeps the session until `release`: a request or a call may outlast the TTL."""
        self.in_use += 1
        self.last_seen = time.monotonic()

    def release(self) -> None:
        self.in_use -= 1
        self.last_seen = time.monotonic()  # the TTL counts from the end of the last use

    def expired(self, cutoff: float) -> bool:
        return not self.in_use and self.last_seen < cutoff


@attrs.define(eq=False)
class _Served:
    name: str
    env: Any  # a core Environment
    shared_tools: tuple[list[ToolSpec], ToolSpec | None] | None = None


def _as_protocol_env(env: Any) -> EnvironmentProtocol:
    if inspect.isclass(env) and issubclass(env, Environment):
        return LocalEnvironment(env)
    if isinstance(env, Environment):
        return LocalEnvironment(type(env))
    if not isinstance(env, EnvironmentProtocol):
        raise TypeError(
            f"{env!r} is neither a plait_sdk.Environment subclass nor a plait environment "
            "(plait.protocols.Environment)"
        )
    return env


@contextlib.asynccontextmanager
async def serving(app: Any, host: str, port: int, name: str = "server") -> AsyncIterator[str]:
    """Serve ASGI `app` with uvicorn in the running event loop until the block ends (signals are
    left to the program it runs in); yields the base URL (port 0: a free one)."""
    import uvicorn

    class QuietServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    server = QuietServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start (e.g. the port is taken)
            raise RuntimeError(f"the {name} stopped before it started")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        await task


def serve_group(cli: click.Group) -> click.Group:
    """The `plait serve` command group, made by the first plugin that adds a service to it."""
    group = cli.commands.get("serve")
    if group is None:

        @cli.group()
        def serve() -> None:
            """Run one of plait's services on its own."""

        group = serve
    if not isinstance(group, click.Group):
        raise TypeError(f"the `plait serve` command is not a command group: {group!r}")
    return group


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    """Serves environments over ORS. The first environment is the default one."""

    def __init__(
        self,
        environments: Sequence[Any],
        return_errors: str = "exception",
        *,
        options: ServerOptions | None = None,
    ) -> None:
        if not environments:
            raise ValueError("Server needs at least one environment")
        self.options = options or ServerOptions()
        self.return_errors = return_errors
        self.envs: dict[str, _Served] = {}
        for env in environments:
            proto = _as_protocol_env(env)
            key = str(proto.name).lower()
            if key in self.envs:
                raise ValueError(
                    f"two environments are named {key!r}; names must be unique (case-insensitive)"
                )
            self.envs[key] = _Served(key, proto)
        self.default_env = next(iter(self.envs))
        self.sessions: dict[str, _Session] = {}
        self.reserved: dict[str, float] = {}  # sids handed out by /create_session
        self._reaper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._version = importlib.metadata.version("plait-sdk")
        self._root_routes, self._env_routes = self._routes()
        self.app: Callable[[Any, Any, Any], Awaitable[None]] = self.asgi
        """The ASGI application uvicorn runs (replace it to wrap the server in middleware)."""

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
        reaped = 0
        for session in list(self.sessions.values()):
            # Checked as each is reached: while an earlier one closes, requests may use this one.
            if session.deleted or not session.expired(cutoff):
                continue
            log.info(
                "session expired",
                sid=session.sid,
                idle_s=round(time.monotonic() - session.last_seen),
            )
            await self._delete(session)
            reaped += 1
        for sid, created in list(self.reserved.items()):
            if created < cutoff:
                self.reserved.pop(sid, None)
        return reaped

    async def _delete(self, session: _Session) -> None:
        """Remove a session; its environment is closed as soon as it has finished opening."""
        if session.deleted:
            return
        session.deleted = True
        self.sessions.pop(session.sid, None)
        for call in session.calls.values():
            call.task.cancel()  # (a no-op for one that has finished)
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
            raise RequestError(
                404, f"unknown environment {env_name!r}; this server serves {sorted(self.envs)}"
            )
        return served

    @staticmethod
    def _sid(request: _Request) -> str:
        sid = request.headers.get("x-session-id", "").strip()
        if not sid:
            raise RequestError(
                400,
                "the X-Session-ID header is required for this endpoint "
                "(get a session id from POST /create_session)",
            )
        if len(sid) > 256 or not sid.isprintable():
            raise RequestError(400, "X-Session-ID must be at most 256 printable characters")
        return sid

    def _session(self, request: _Request, env_name: str | None = None) -> _Session:
        sid = self._sid(request)
        session = self.sessions.get(sid)
        if session is None:
            hint = (
                "POST /create has not been called for it yet"
                if sid in self.reserved
                else "it was never created, was deleted, or expired after "
                f"{self.options.session_ttl_s:g} s without requests"
            )
            raise RequestError(404, f"no active session {sid!r}: {hint}")
        if env_name is not None and env_name.lower() != session.env_name:
            self._env(env_name)  # an unknown environment is a 404 of its own
            raise RequestError(
                400,
                f"session {sid!r} belongs to environment {session.env_name!r}, not {env_name!r}",
            )
        request.use(session)
        return session

    async def _ready(self, session: _Session) -> EnvSession:
        """The open environment session, waiting for setup up to `setup_wait_s`."""
        opening = session.opening
        if (
            not opening.done()
        ):  # (asyncio.wait neither cancels the setup nor mistakes its own errors)
            await asyncio.wait((opening,), timeout=self.options.setup_wait_s)
            if not opening.done():
                raise RequestError(
                    503,
                    f"session {session.sid!r} is still running setup(); retry after "
                    f"{self.options.retry_after_s} s",
                    {"Retry-After": str(self.options.retry_after_s), "X-Backend-State": "starting"},
                )
        try:
            return opening.result()
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            if session.task_from_client:
                raise RequestError(
                    422, f"the environment could not open the task_spec sent to /create: {message}"
                ) from exc
            raise _EnvironmentFailure(f"environment setup failed: {message}") from exc

    async def _body(self, request: _Request, model: type[_Body]) -> Any:
        length = request.headers.get("content-length")
        if length is not None and (
            not length.isdigit() or int(length) > self.options.max_body_bytes
        ):
            raise RequestError(
                413, f"request body is larger than {self.options.max_body_bytes} bytes"
            )
        raw = await request.body(self.options.max_body_bytes)
        fields = ", ".join(model.model_fields)
        if not raw.strip():
            raise RequestError(
                422, f"{request.method} {request.path} needs a JSON object body (fields: {fields})"
            )
        try:
            data = parse_json(raw, self.options.max_json_depth)
        except ValueError as exc:
            raise RequestError(
                422,
                f"request body is not valid JSON ({exc}); send a JSON object (fields: {fields})",
            ) from None
        if not isinstance(data, dict):
            raise RequestError(
                422,
                f"request body must be a JSON object (fields: {fields}), got {type(data).__name__}",
            )
        try:
            return model.model_validate(data)
        except pydantic.ValidationError as exc:
            raise RequestError(
                422, f"invalid body for {request.method} {request.path}: {_validation_message(exc)}"
            ) from None

    async def _check_split(self, served: _Served, split: str) -> None:
        names = [s.name for s in await served.env.splits()]
        if split not in names:
            raise RequestError(
                400, f"environment {served.name!r} has no split {split!r}; its splits are {names}"
            )

    async def _num_tasks(self, served: _Served, split: str) -> int:
        await self._check_split(served, split)
        return int(await served.env.num_tasks(split))

    async def _task(self, served: _Served, split: str, index: int) -> dict[str, Any]:
        total = await self._num_tasks(served, split)
        if not 0 <= index < total:
            raise RequestError(
                400,
                f"task index {index} is out of range for split {split!r} "
                f"(it has {total} tasks: 0..{total - 1})",
            )
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

    def _secrets(self, request: _Request, body: CreateBody) -> dict[str, str]:
        secrets = dict(body.secrets or {})
        raw = request.headers.get("x-secrets", "").strip()
        if not raw:
            return secrets
        try:
            payload = parse_json(base64.b64decode(raw, validate=True), self.options.max_json_depth)
        except ValueError as exc:  # binascii.Error is a ValueError too
            raise RequestError(
                400, f"the X-Secrets header must be base64 of a JSON object ({exc})"
            ) from None
        if not isinstance(payload, dict):
            raise RequestError(
                400, 'the X-Secrets header must encode a JSON object {NAME: {"value": ...}}'
            )
        for key, value in payload.items():
            if isinstance(value, dict) and isinstance(value.get("value"), str):
                secrets[key] = value["value"]
            elif isinstance(value, str):
                secrets[key] = value
            else:
                raise RequestError(
                    400, f'X-Secrets entry {key!r} must be a string or {{"value": str}}'
                )
        return secrets

    def _stream(self, call: _Call) -> _EventStream:
        async def events() -> AsyncIterator[bytes]:
            yield sse.event("task_id", call.task_id)
            while not call.task.done():
                await asyncio.wait((call.task,), timeout=self.options.ping_interval_s)
                if not call.task.done():
                    yield sse.ping_comment()
            error = call.error()
            if error is not None:
                yield sse.event("error", error)
            else:  # every piece at once: one write, not one per 4096 characters
                yield b"".join(sse.result_events(call.task.result()))

        return _EventStream(events())

    def _start_call(self, session: _Session, work: Callable[[], Any]) -> _Call:
        task_id = uuid.uuid4().hex

        async def run() -> str:
            return dumps(await work())

        session.hold()  # until the call ends, which may be long after this request's handler
        call = _Call(task_id, asyncio.ensure_future(run()))

        def finish(_task: asyncio.Task[str]) -> None:
            session.release()
            error = call.error()
            if error is not None and not call.task.cancelled():
                log.warning("call failed", sid=session.sid, error=error)
            asyncio.get_running_loop().call_later(
                self.options.result_linger_s, session.calls.pop, task_id, None
            )

        call.task.add_done_callback(finish)
        session.calls[task_id] = call
        return call

    def _resume(self, session: _Session, task_id: str) -> _Call:
        call = session.calls.get(task_id)
        if call is None:
            raise RequestError(
                404,
                f"unknown task_id {task_id!r} for session {session.sid!r}: results are "
                f"kept {self.options.result_linger_s:g} s after a call ends; send the "
                "call again without task_id",
            )
        return call

    # -- the ASGI application ----------------------------------------------------------------------
    #
    # A plain ASGI app with a table of routes rather than a web framework: the request handling is
    # all here, the routes are fixed, and a framework's layers (middleware, routing scans, response
    # models) cost more CPU per request than the handlers themselves.

    async def asgi(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._ensure_reaper()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close_all()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Any, receive: Any, send: Any) -> None:
        self._ensure_reaper()
        request = _Request(scope, receive)
        # Every failure is answered here, before the response starts: the connection stays usable.
        try:
            key = self.options.api_key
            if key and request.path != "/health" and not key_matches(request.headers, key):
                raise RequestError(401, "missing or wrong API key: send it in the X-API-Key header")
            handler, env_name = self._route(request)
            try:
                result = await handler(request, env_name)
            finally:
                if request.session is not None:
                    request.session.release()
            if not isinstance(result, _EventStream):
                result = _json(result)
        except RequestError as exc:
            await _send_json(send, exc.status, _json({"detail": exc.detail}), exc.headers)
            return
        except _EnvironmentFailure as exc:
            await _send_json(send, 500, _json({"detail": str(exc)}))
            return
        except Exception as exc:
            # Only the environment's own code gets here: every request problem is a RequestError.
            log.error(
                "environment code failed", path=request.path, error=f"{type(exc).__name__}: {exc}"
            )
            detail = (
                f"the environment failed: {type(exc).__name__}: {exc}"
                if self.return_errors != "none"
                else "the environment failed"
            )
            await _send_json(send, 500, _json({"detail": detail}))
            return
        if isinstance(result, _EventStream):
            await result.send(send)
        else:
            await _send_json(send, 200, result)

    def _route(self, request: _Request) -> tuple[_Handler, str | None]:
        """The handler for a request, and the environment its path names (None: the default one)."""
        first, _, rest = request.path[1:].partition("/")
        if not rest:  # /create, /health, ... and the default environment's /splits, /call, ...
            methods, env_name = self._root_routes.get(first) or self._env_routes.get(first), None
        else:
            methods, env_name = (None if "/" in rest else self._env_routes.get(rest)), first
        if methods is None:
            raise RequestError(
                404,
                f"no endpoint {request.method} {request.path}; ORS endpoints are "
                f"{ENDPOINTS}; environments: {sorted(self.envs)}",
            )
        handler = methods.get(request.method)
        if handler is None:
            allowed = ", ".join(methods)
            raise RequestError(
                405,
                f"{request.method} is not allowed on {request.path}; use {allowed}",
                {"Allow": allowed},
            )
        return handler, env_name

    def _routes(self) -> tuple[dict[str, dict[str, _Handler]], dict[str, dict[str, _Handler]]]:
        """Routes at the root (/NAME), and per environment (/{env}/NAME, and /NAME for the default
        one)."""
        root: dict[str, dict[str, _Handler]] = {
            "health": {"GET": self._health},
            "version": {"GET": self._version_route},
            "list_environments": {"GET": self._list_environments},
            "create_session": {"POST": self._create_session},
            "create": {"POST": self._create},
            "ping": {"POST": self._ping},
            "delete": {"POST": self._delete_route},
            "delete_session": {"POST": self._delete_session},
        }
        per_env: dict[str, dict[str, _Handler]] = {
            "splits": {"GET": self._splits},
            "tasks": {"POST": self._tasks},
            "num_tasks": {"POST": self._num_tasks_route},
            "task": {"POST": self._task_route},
            "task_range": {"POST": self._task_range},
            "tools": {"GET": self._tools},
            "task_tools": {"GET": self._task_tools},
            "prompt": {"GET": self._prompt},
            "messages": {"GET": self._messages},
            "call": {"POST": self._call},
            "score_group": {"POST": self._score_group},
        }
        return root, per_env

    # -- handlers: (request, environment named by the path or None) -> JSON value or event stream --

    async def _health(self, _request: _Request, _env_name: str | None) -> Any:
        return {"status": "ok"}

    async def _version_route(self, _request: _Request, _env_name: str | None) -> Any:
        return {"version": self._version, "build_sha": None, "server": "plait-sdk"}

    async def _list_environments(self, _request: _Request, _env_name: str | None) -> Any:
        return list(self.envs)

    async def _create_session(self, _request: _Request, _env_name: str | None) -> Any:
        if len(self.reserved) >= self.options.max_sessions:
            raise RequestError(
                429,
                "too many session ids are outstanding; delete unused ones with "
                "POST /delete_session",
                {"Retry-After": str(self.options.retry_after_s)},
            )
        sid = str(uuid.uuid4())
        self.reserved[sid] = time.monotonic()

        async def events() -> AsyncIterator[bytes]:
            yield sse.event("task_id", sid) + sse.event("end", "")

        return _EventStream(events())

    async def _create(self, request: _Request, _env_name: str | None) -> Any:
        sid = self._sid(request)
        body: CreateBody = await self._body(request, CreateBody)
        if body.toolset_name is not None:
            raise RequestError(
                400,
                f"toolset_name {body.toolset_name!r} is not supported: this server "
                "has no platform toolsets; leave it out",
            )
        has_spec = body.task_spec is not None
        has_index = body.split is not None or body.index is not None
        if has_spec == has_index:
            raise RequestError(422, "give exactly one of task_spec, or split and index together")
        if (body.split is None) != (body.index is None):
            raise RequestError(422, "split and index must be given together")
        served = self._env(body.env_name)
        task = (
            body.task_spec
            if body.task_spec is not None
            else await self._task(served, body.split or "", body.index or 0)
        )
        secrets = self._secrets(request, body)
        # Checked here, after the last await, so that no concurrent /create with the same id can
        # pass the check too: a second environment would be built and never torn down.
        if sid in self.sessions:
            raise RequestError(
                409, f"session {sid!r} already exists; POST /delete it first or use a new id"
            )
        if len(self.sessions) >= self.options.max_sessions:
            raise RequestError(
                429,
                f"this server holds {len(self.sessions)} sessions, its limit; delete finished ones",
                {"Retry-After": str(self.options.retry_after_s)},
            )
        opening = asyncio.ensure_future(served.env.open(task, secrets))
        opening.add_done_callback(_consume_exception)
        session = self.sessions[sid] = _Session(
            sid, served.name, has_spec, opening, time.monotonic()
        )
        request.use(session)  # while the includes wait for setup
        wanted = [
            name.strip() for name in request.headers.get(INCLUDE_HEADER.lower(), "").split(",")
        ]
        return {
            "sid": sid,
            **await self._included(session, [name for name in INCLUDABLE if name in wanted]),
        }

    async def _included(self, session: _Session, names: list[str]) -> dict[str, Any]:
        """The answers of the routes `names` for a new session (the X-Plait-Include extension):
        none when setup did not finish within setup_wait_s or failed, or a route's answer failed."""
        if not names:
            return {}
        await asyncio.wait((session.opening,), timeout=self.options.setup_wait_s)
        if (
            session.deleted
            or not session.opening.done()
            or session.opening.cancelled()
            or session.opening.exception()
        ):
            return {}
        env_session = session.opening.result()
        answers = {"messages": self._messages_wire, "task_tools": self._tools_wire}
        try:
            return {name: await answers[name](env_session) for name in names}
        except Exception as exc:  # the route reports it when the client asks
            log.debug(
                "create could not include the routes' answers", sid=session.sid, error=repr(exc)
            )
            return {}

    async def _ping(self, request: _Request, _env_name: str | None) -> Any:
        self._session(request)
        return {"status": "ok"}

    async def _delete_route(self, request: _Request, _env_name: str | None) -> Any:
        session = self._session(request)
        await self._delete(session)
        return {"sid": session.sid}

    async def _delete_session(self, request: _Request, _env_name: str | None) -> Any:
        sid = self._sid(request)
        known = self.reserved.pop(sid, None) is not None
        session = self.sessions.get(sid)
        if session is not None:
            await self._delete(session)
        elif not known:
            raise RequestError(
                404,
                f"no session id {sid!r}: it was never handed out by /create_session, "
                "or was already deleted",
            )
        return {"sid": sid}

    async def _splits(self, _request: _Request, env_name: str | None) -> Any:
        return [split_to_wire(s) for s in await self._env(env_name).env.splits()]

    async def _tasks(self, request: _Request, env_name: str | None) -> Any:
        served = self._env(env_name)
        body: SplitBody = await self._body(request, SplitBody)
        total = await self._num_tasks(served, body.split)
        return {
            "tasks": [dict(await served.env.get_task(body.split, i)) for i in range(total)],
            "env_name": served.name,
        }

    async def _num_tasks_route(self, request: _Request, env_name: str | None) -> Any:
        served = self._env(env_name)
        body: SplitBody = await self._body(request, SplitBody)
        return {"num_tasks": await self._num_tasks(served, body.split)}

    async def _task_route(self, request: _Request, env_name: str | None) -> Any:
        served = self._env(env_name)
        body: TaskBody = await self._body(request, TaskBody)
        return {"task": await self._task(served, body.split, body.index), "env_name": served.name}

    async def _task_range(self, request: _Request, env_name: str | None) -> Any:
        served = self._env(env_name)
        body: TaskRangeBody = await self._body(request, TaskRangeBody)
        total = await self._num_tasks(served, body.split)
        indices = range(*slice(body.start, body.stop).indices(total))
        return {
            "tasks": [dict(await served.env.get_task(body.split, i)) for i in indices],
            "env_name": served.name,
        }

    async def _tools(self, _request: _Request, env_name: str | None) -> Any:
        served = self._env(env_name)
        shared, terminal = await self._shared_tools(served)
        supports = getattr(served.env, "supports_score_group", lambda: False)()
        return list_tools_to_wire(shared, terminal, supports)

    async def _task_tools(self, request: _Request, env_name: str | None) -> Any:
        return await self._tools_wire(await self._ready(self._session(request, env_name)))

    @staticmethod
    async def _tools_wire(env_session: EnvSession) -> Any:
        supports = getattr(env_session, "supports_score_group", lambda: False)()
        return list_tools_to_wire(
            await env_session.tools(), await env_session.terminal_tool(), supports
        )

    async def _prompt(self, request: _Request, env_name: str | None) -> Any:
        env_session = await self._ready(self._session(request, env_name))
        return [block_to_wire(b) for b in await env_session.prompt()]

    async def _messages(self, request: _Request, env_name: str | None) -> Any:
        return await self._messages_wire(await self._ready(self._session(request, env_name)))

    @staticmethod
    async def _messages_wire(env_session: EnvSession) -> Any:
        found: list[Message] = await env_session.messages()
        return [message_to_wire(m) for m in found]

    async def _call(self, request: _Request, env_name: str | None) -> Any:
        session = self._session(request, env_name)
        body: ToolCallBody = await self._body(request, ToolCallBody)
        if body.task_id is not None:
            return self._stream(self._resume(session, body.task_id))
        env_session = await self._ready(session)

        async def work() -> dict[str, Any]:
            return run_tool_result_to_wire(await env_session.call(body.name, body.input))

        return self._stream(self._start_call(session, work))

    async def _score_group(self, request: _Request, env_name: str | None) -> Any:
        session = self._session(request, env_name)
        body: ScoreGroupBody = await self._body(request, ScoreGroupBody)
        if body.task_id is not None:
            return self._stream(self._resume(session, body.task_id))
        env_session = await self._ready(session)
        if not getattr(env_session, "supports_score_group", lambda: False)():
            raise RequestError(
                404, f"environment {session.env_name!r} does not implement score_group"
            )

        async def work() -> dict[str, Any]:
            scores = await env_session.score_group(body.candidates)  # type: ignore[attr-defined]
            if len(scores) != len(body.candidates):
                raise ValueError(
                    f"score_group returned {len(scores)} scores for "
                    f"{len(body.candidates)} candidates"
                )
            return {"scores": [{"reward": s, "metadata": None} for s in scores]}

        return self._stream(self._start_call(session, work))

    # -- running ---------------------------------------------------------------------------------

    def run(self, host: str = "127.0.0.1", port: int = 8080) -> None:
        """Serve until interrupted. Loopback by default; another host needs an API key."""
        import uvicorn

        self._check_host(host)
        log.info("serving", url=f"http://{host}:{port}", environments=list(self.envs))
        uvicorn.Server(self._uvicorn_config(host=host, port=port)).run()

    def _uvicorn_config(self, **settings: Any) -> Any:
        import uvicorn

        # loop and http stay "auto": uvloop and httptools when installed (plait-sdk depends on
        # them where they exist), the pure-Python ones elsewhere.
        return uvicorn.Config(
            self.app,
            interface="asgi3",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            **settings,
        )

    def _check_host(self, host: str) -> None:
        if not is_loopback(host) and not self.options.api_key:
            raise PlaitError(
                f"refusing to serve on {host}, which is not a loopback address, without an API key",
                fix="set an API key (plait env serve --api-key / ServerOptions(api_key=...)) "
                "or serve on 127.0.0.1",
            )

    @contextlib.contextmanager
    def serve_in_thread(self, host: str = "127.0.0.1") -> Iterator[str]:
        """Serve on a free loopback port in a background thread; yields the base URL."""
        import uvicorn

        self._check_host(host)
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only when the
        # listening socket says so, and without it each keep-alive request waits ~40 ms
        # (delayed ACK).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(self._uvicorn_config(lifespan="on"))
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"ors-server-{port}"
        )
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


class _Request:
    """What the handlers read of an HTTP request. A trailing slash is dropped from the path, so
    `/env/splits/` is served as `/env/splits` (never redirected)."""

    __slots__ = ("_receive", "headers", "method", "path", "session")

    def __init__(self, scope: Any, receive: Any) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"].rstrip("/") or "/"
        self.headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope["headers"]
        }
        self._receive = receive
        self.session: _Session | None = None
        """The session the request names, held while its handler runs."""

    def use(self, session: _Session) -> None:
        """Holds `session` until the handler ends (`Server._http` releases it)."""
        if self.session is None:
            self.session = session
            session.hold()

    async def body(self, limit: int) -> bytes:
        """The whole body; a 413 as soon as it grows past `limit` bytes, without reading the
        rest."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise RequestError(400, "the client disconnected before it sent the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise RequestError(413, f"request body is larger than {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


_Handler = Callable[[_Request, str | None], Awaitable[Any]]
_SSE_RAW_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    *((name.lower().encode(), value.encode()) for name, value in SSE_HEADERS.items()),
]


class _EventStream:
    """A `text/event-stream` answer; each piece goes out as soon as it is made."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        self.events = events

    async def send(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_RAW_HEADERS})
        async for piece in self.events:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _json(data: Any) -> bytes:
    return dumps(data).encode()


async def _send_json(
    send: Any, status: int, body: bytes, headers: Mapping[str, str] | None = None
) -> None:
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    raw_headers += [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in (headers or {}).items()
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


def key_matches(headers: Mapping[str, str], key: str) -> bool:
    sent = headers.get("x-api-key", "")
    bearer = headers.get("authorization", "")
    if not sent and bearer.lower().startswith("bearer "):
        sent = bearer[7:].strip()
    return hmac.compare_digest(sent.encode("latin-1"), key.encode())


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
