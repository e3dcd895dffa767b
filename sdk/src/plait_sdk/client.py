"""A plait environment backed by any ORS server (httpx, async).

    env = ORSEnvironment(ORSOptions(url="http://127.0.0.1:8080", env_name="gsm8k"))
    session = await env.open(await env.get_task("train", 0))

In a run config: `env.name = "ors"` with `env.options = {url = "...", env_name = "...", ...}`.

It speaks the wire protocol of both official SDKs (reference/ors.md) and of plait's own server:
SSE results (`task_id` / `chunk` / `end` / `error`), resuming a dropped `/call` stream with its
`task_id`, a keep-alive `POST /ping` every `ping_interval_s`, retries with exponential back-off
that honour `Retry-After` (429, 502, 503 — also the 503 "starting" answer while setup runs — 504
and connection errors), and fall-backs for older servers (`/task_tools` -> `/tools`,
`/messages` -> `/prompt`, secrets in the body for servers without `/version`). It also enforces
the finished latch itself, because ors-sdk servers do not.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import functools
import json
import logging
import os
import ssl
import time
from collections.abc import Mapping
from typing import Any

import attrs
import httpx
import structlog

from plait.errors import EnvironmentError_
from plait.types import Block, Message, Split, ToolError, ToolOutput, ToolSpec
from plait_sdk import sse
from plait_sdk.types import (
    TerminalToolSpec,
    block_from_wire,
    message_from_wire,
    prompt_as_messages,
    run_tool_result_from_wire,
    split_from_wire,
    terminal_tool_to_spec,
    tool_spec_from_wire,
)

log = structlog.get_logger("plait_sdk.client")

RETRY_STATUSES = frozenset({429, 502, 503, 504})

# httpx logs every request at INFO ("HTTP Request: ..."), and loading plait's plugins configures
# logging at INFO, so a run would print a line per ORS request. Quieted unless someone chose a
# level for httpx's logger themselves.
if logging.getLogger("httpx").level == logging.NOTSET:
    logging.getLogger("httpx").setLevel(logging.WARNING)


@attrs.frozen
class ORSOptions:
    """Where the ORS server is and how patiently to talk to it."""

    url: str
    env_name: str | None = None
    """The environment on the server; default its first one (GET /list_environments)."""
    api_key: str | None = None
    """Sent as X-API-Key; default the ORS_API_KEY environment variable."""
    splits: list[str] = attrs.field(factory=list)
    """Use only these splits (default all the server lists)."""
    request_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 30.0
    """Longest silence on an SSE stream (the server pings every 10 s) before it counts as dropped."""
    setup_timeout_s: float = 600.0
    """How long to keep retrying while the server answers 503 (setup still running)."""
    max_retries: int = 5
    backoff_base_s: float = 0.5
    backoff_max_s: float = 10.0
    ping_interval_s: float = 10.0


class ServerError(EnvironmentError_):
    """The ORS server refused a request (a 4xx/5xx after retries); `status` is the HTTP status."""

    def __init__(self, message: str, status: int, *, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.status = status


class _RemoteToolError(Exception):
    """The server sent `event: error` (the tool raised)."""


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header in seconds (it may be a number or an HTTP date)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def secrets_header(secrets: Mapping[str, str]) -> str:
    payload = {k: {"value": v} for k, v in secrets.items()}
    return base64.b64encode(json.dumps(payload).encode()).decode()


def _detail(response: httpx.Response) -> str:
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    return str(data.get("detail", data)) if isinstance(data, dict) else str(data)[:500]


class ORSEnvironment:
    """The core `Environment` protocol over HTTP to an ORS server."""

    def __init__(self, options: ORSOptions) -> None:
        self.options = options
        self.url = options.url.rstrip("/")
        self.api_key = options.api_key if options.api_key is not None else os.environ.get("ORS_API_KEY")
        self.name = options.env_name or "ors"
        self._env_name: str | None = options.env_name.lower() if options.env_name else None
        self.http = _HTTP(self.url, options.request_timeout_s, max_connections=None)
        self._has_version: bool | None = None
        # Optional routes this server turned out to lack (404), remembered for every later session:
        # ors-sdk servers have no /messages, and asking each session again costs a request.
        self.missing_routes: set[str] = set()

    @classmethod
    def from_options(cls, *, options: ORSOptions) -> ORSEnvironment:
        return cls(options)

    # -- HTTP --------------------------------------------------------------------------------

    def headers(self, sid: str | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {"User-Agent": "plait-sdk"}
        if self.api_key:
            headers["X-API-Key"] = self.api_key
        if sid:
            headers["X-Session-ID"] = sid
        headers.update(extra or {})
        return headers

    async def _backoff(self, attempt: int, retry_after: float | None) -> None:
        delay = min(self.options.backoff_max_s, self.options.backoff_base_s * 2 ** (attempt - 1))
        await asyncio.sleep(max(delay, retry_after or 0.0))

    async def request(self, method: str, path: str, *, sid: str | None = None, body: Any = None,
                      extra_headers: Mapping[str, str] | None = None, http: _HTTP | None = None) -> Any:
        """One JSON request with retries; raises ServerError with the server's own message."""
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                response = await (http or self.http).client().request(
                    method, path, json=body, headers=self.headers(sid, extra_headers))
            except httpx.TransportError as exc:
                failure: str = f"{type(exc).__name__}: {exc}"
                retry_after = None
            else:
                if response.status_code < 400:
                    return response.json() if response.content else None
                failure = f"HTTP {response.status_code}: {_detail(response)}"
                retry_after, starting = self._retryable(method, path, response, started)
                if starting:
                    attempt = min(attempt, 1)
            attempt += 1
            if attempt > self.options.max_retries:
                raise ServerError(f"ORS server {self.url} failed {method} {path} {attempt} times; last: {failure}",
                                  0, fix="check that the server runs and is reachable")
            log.debug("retrying", method=method, path=path, attempt=attempt, failure=failure)
            await self._backoff(attempt, retry_after)

    def _retryable(self, method: str, path: str, response: httpx.Response, started: float) -> tuple[float | None, bool]:
        """For a failed answer worth retrying: its Retry-After, and whether the server is only
        starting (a 503 within setup_timeout_s: waited out, not counted as a failure). Raises
        ServerError for one that is not worth retrying."""
        if response.status_code not in RETRY_STATUSES:
            raise self._error(method, path, response.status_code, _detail(response))
        starting = response.status_code == 503 and time.monotonic() - started < self.options.setup_timeout_s
        return retry_after_seconds(response.headers.get("retry-after")), starting

    def _error(self, method: str, path: str, status: int, detail: str) -> ServerError:
        fix = None
        if status == 401:
            fix = "set the server's API key (options.api_key or ORS_API_KEY)"
        elif status == 404 and "environment" in detail:
            fix = "check options.env_name against the server's GET /list_environments"
        return ServerError(f"ORS server {self.url}: {method} {path} answered {status}: {detail}", status, fix=fix)

    async def stream(self, path: str, body: Mapping[str, Any], *, sid: str | None = None,
                     extra_headers: Mapping[str, str] | None = None, http: _HTTP | None = None) -> str:
        """POST an SSE endpoint and return the joined result text; resumes a dropped stream."""
        task_id: str | None = None
        attempt = 0
        started = time.monotonic()
        timeout = httpx.Timeout(self.options.request_timeout_s, connect=10.0,
                                read=self.options.heartbeat_timeout_s)
        while True:
            payload = dict(body)
            if task_id is not None:
                payload["task_id"] = task_id
            retry_after = None
            try:
                async with (http or self.http).client().stream("POST", path, json=payload, timeout=timeout,
                                                headers=self.headers(sid, extra_headers)) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        failure = f"HTTP {response.status_code}: {_detail(response)}"
                        retry_after, starting = self._retryable("POST", path, response, started)
                        if starting:
                            attempt = min(attempt, 1)
                    elif "text/event-stream" not in response.headers.get("content-type", ""):
                        data = json.loads(await response.aread() or b"null")
                        return json.dumps(data)  # a server that answers plain JSON (the spec's docs do)
                    else:
                        pieces: list[str] = []
                        async for name, data in sse.parse_events(response.aiter_lines()):
                            if name == "task_id":
                                task_id = data.strip()
                            elif name == "chunk":
                                pieces.append(data)
                            elif name == "end":
                                pieces.append(data)
                                return "".join(pieces)
                            elif name == "error":
                                raise _RemoteToolError(data or "the server reported an error without a message")
                        failure = "the stream ended before its end event"
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            attempt += 1
            if attempt > self.options.max_retries:
                raise ServerError(f"ORS server {self.url}: POST {path} failed {attempt} times; last: {failure}", 0,
                                  fix="check that the server runs and is reachable")
            log.debug("stream dropped; resuming" if task_id else "retrying", path=path, attempt=attempt,
                      failure=failure)
            await self._backoff(attempt, retry_after)

    # -- discovery ---------------------------------------------------------------------------

    async def env_name(self) -> str:
        if self._env_name is None:
            names = await self.request("GET", "/list_environments")
            if not names:
                raise ServerError(f"ORS server {self.url} serves no environments", 0)
            self._env_name = str(names[0]).lower()
            self.name = self._env_name
        return self._env_name

    async def path(self, suffix: str) -> str:
        return f"/{await self.env_name()}/{suffix}"

    async def has_version_route(self) -> bool:
        """openreward and plait servers answer GET /version; ors-sdk 0.1.0 does not."""
        if self._has_version is None:
            try:
                await self.request("GET", "/version")
                self._has_version = True
            except ServerError as exc:
                if exc.status != 404:
                    raise
                self._has_version = False
        return self._has_version

    async def splits(self) -> list[Split]:
        found = [split_from_wire(s) for s in await self.request("GET", await self.path("splits"))]
        if not self.options.splits:
            return found
        by_name = {s.name: s for s in found}
        missing = [n for n in self.options.splits if n not in by_name]
        if missing:
            raise EnvironmentError_(f"ORS environment {self.name!r} has no split(s) {missing}; it has {sorted(by_name)}",
                                    fix="fix env.options.splits")
        return [by_name[n] for n in self.options.splits]

    async def _check_split(self, split: str) -> None:
        if self.options.splits and split not in self.options.splits:
            raise KeyError(f"split {split!r} is not among env.options.splits {self.options.splits}")

    async def num_tasks(self, split: str) -> int:
        await self._check_split(split)
        return int((await self.request("POST", await self.path("num_tasks"), body={"split": split}))["num_tasks"])

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        await self._check_split(split)
        if index < 0:
            raise IndexError(f"task index {index} is negative")
        try:
            answer = await self.request("POST", await self.path("task"), body={"split": split, "index": index})
        except ServerError as exc:
            if exc.status == 400:
                raise IndexError(exc.message) from exc
            raise
        return dict(answer["task"])

    # -- sessions ----------------------------------------------------------------------------

    async def _create_session_sid(self) -> str:
        """A session id from /create_session: its SSE task_id event (plain JSON {"sid"} in the spec's docs)."""
        sid: str | None = None
        async with self.http.client().stream("POST", "/create_session", json={},
                                             headers=self.headers()) as response:
            if response.status_code >= 400:
                await response.aread()
                raise self._error("POST", "/create_session", response.status_code, _detail(response))
            if "text/event-stream" not in response.headers.get("content-type", ""):
                data = json.loads(await response.aread() or b"{}")
                sid = data.get("sid") if isinstance(data, dict) else None
            else:
                async for name, data in sse.parse_events(response.aiter_lines()):
                    if name == "task_id":
                        sid = data.strip()
                    elif name in ("end", "error"):
                        break
        if not sid:
            raise ServerError(f"ORS server {self.url}: /create_session sent no session id", 0)
        return sid

    async def open(self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None) -> ORSSession:
        sid = await self._with_retries(self._create_session_sid)
        body: dict[str, Any] = {"env_name": await self.env_name(), "task_spec": dict(task)}
        extra: dict[str, str] = {}
        if secrets:
            if await self.has_version_route():
                extra["X-Secrets"] = secrets_header(secrets)
            else:  # ors-sdk's server reads secrets from the body only
                body["secrets"] = dict(secrets)
        session = ORSSession(self, sid)
        try:
            await self.request("POST", "/create", sid=sid, body=body, extra_headers=extra, http=session.http)
        except BaseException:
            await session.close()
            raise
        session.start_pinging()
        return session

    async def _with_retries(self, work: Any) -> Any:
        attempt = 0
        while True:
            try:
                return await work()
            except httpx.TransportError as exc:
                attempt += 1
                if attempt > self.options.max_retries:
                    raise ServerError(f"ORS server {self.url} unreachable: {type(exc).__name__}: {exc}", 0,
                                      fix="check that the server runs and options.url is right") from exc
                await self._backoff(attempt, None)

    async def close(self) -> None:
        await self.http.close()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One TLS context for every client: building one loads the CA bundle (tens of ms)."""
    return httpx.create_ssl_context()


class _HTTP:
    """An httpx client for the running event loop (made anew when the loop changes).

    Each session gets its own small one: httpcore's connection pool does work proportional to its
    size on every request, so one pool shared by many concurrent sessions slows them all down.
    """

    def __init__(self, url: str, timeout_s: float, max_connections: int | None) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            self._client = httpx.AsyncClient(
                base_url=self.url, follow_redirects=True, timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                verify=_ssl_context(),
                limits=httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=32))
            self._loop = loop
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(RuntimeError):  # its event loop is gone; the sockets went with it
                await client.aclose()


class ORSSession:
    """One episode on an ORS server."""

    def __init__(self, env: ORSEnvironment, sid: str) -> None:
        self.env = env
        self.sid = sid
        self.finished = False
        self.closed = False
        self.lost: str | None = None  # why the server no longer has this session
        self._tools: list[ToolSpec] | None = None
        self._terminal: ToolSpec | None = None
        self._pinger: asyncio.Task[None] | None = None
        self.http = _HTTP(env.url, env.options.request_timeout_s, max_connections=8)

    async def _request(self, method: str, path: str) -> Any:
        return await self.env.request(method, path, sid=self.sid, http=self.http)

    async def _stream(self, suffix: str, body: Mapping[str, Any]) -> str:
        return await self.env.stream(await self.env.path(suffix), body, sid=self.sid, http=self.http)

    def start_pinging(self) -> None:
        self._pinger = asyncio.ensure_future(self._ping_forever())

    async def _ping_forever(self) -> None:
        while not self.closed:
            await asyncio.sleep(self.env.options.ping_interval_s)
            try:
                await self._request("POST", "/ping")
            except ServerError as exc:
                if exc.status == 404:
                    self.lost = exc.message
                    log.warning("ORS session lost", sid=self.sid, detail=exc.message)
                    return
                log.warning("ORS ping failed", sid=self.sid, error=exc.message)

    async def prompt(self) -> list[Block]:
        return [block_from_wire(b) for b in await self._request("GET", await self.env.path("prompt"))]

    async def _optional_route(self, suffix: str) -> Any:
        """GET an optional route; None if this server lacks it (learned once per server)."""
        if suffix in self.env.missing_routes:
            return None
        try:
            return await self._request("GET", await self.env.path(suffix))
        except ServerError as exc:
            if not _route_missing(exc):
                raise
            self.env.missing_routes.add(suffix)
            return None

    async def messages(self) -> list[Message]:
        found = await self._optional_route("messages")
        if found is not None:
            return [message_from_wire(m) for m in found]
        return prompt_as_messages(await self.prompt())

    async def _list_tools(self) -> None:
        listing = await self._optional_route("task_tools")
        if listing is None:
            listing = await self._request("GET", await self.env.path("tools"))
        self._tools = [tool_spec_from_wire(t) for t in listing.get("tools") or []]
        terminal = listing.get("terminal_tool")
        self._terminal = None
        if isinstance(terminal, Mapping) and isinstance(terminal.get("name"), str):
            self._terminal = terminal_tool_to_spec(TerminalToolSpec(
                name=terminal["name"], arg=terminal.get("arg"), description=str(terminal.get("description") or "")))

    async def tools(self) -> list[ToolSpec]:
        if self._tools is None:
            await self._list_tools()
        return list(self._tools or [])

    async def terminal_tool(self) -> ToolSpec | None:
        if self._tools is None:
            await self._list_tools()
        return self._terminal

    async def call(self, name: str, input: Mapping[str, Any]) -> ToolOutput | ToolError:
        if self.closed:
            return ToolError(f"{name!r} was not run: the session is closed", "episode_finished")
        if self.finished:
            return ToolError(f"{name!r} was not run: the episode has finished (a tool returned finished=True)",
                             "episode_finished")
        if self.lost:
            return ToolError(f"{name!r} was not run: the server lost the session ({self.lost})", "exception")
        if not isinstance(input, Mapping):
            return ToolError(f"tool input must be a JSON object, got {type(input).__name__}", "input_validation")
        try:
            text = await self._stream("call", {"name": name, "input": dict(input)})
            result = run_tool_result_from_wire(json.loads(text))
        except _RemoteToolError as exc:
            return ToolError(f"tool {name!r} failed on the server: {exc}", "exception")
        except ServerError as exc:
            return ToolError(f"tool {name!r} could not be called: {exc.message}", "exception")
        except (ValueError, httpx.HTTPError) as exc:
            return ToolError(f"tool {name!r}: the server's answer could not be read: {type(exc).__name__}: {exc}",
                             "exception")
        if isinstance(result, ToolOutput) and result.finished:
            self.finished = True
        return result

    async def score_group(self, candidates: list[Mapping[str, Any]]) -> list[float]:
        text = await self._stream("score_group", {"candidates": list(candidates)})
        return [float(s["reward"]) for s in json.loads(text)["scores"]]

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._pinger is not None:
            self._pinger.cancel()
        for path in ("/delete", "/delete_session"):
            try:
                await self._request("POST", path)
                if path == "/delete":
                    break  # /delete_session does nothing on the server (ORS); only servers without /delete need it
            except (ServerError, httpx.HTTPError, RuntimeError) as exc:
                # already gone, or a server without the route: closing must never fail the caller
                log.debug("ORS close step failed", path=path, sid=self.sid, error=str(exc))
        await self.http.close()


def _route_missing(exc: ServerError) -> bool:
    """A 404 for a route an older server lacks (not for a missing session or environment)."""
    return exc.status == 404 and ("Not Found" in exc.message or "no endpoint" in exc.message)
