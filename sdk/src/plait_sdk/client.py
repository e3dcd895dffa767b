"""A plait environment backed by any ORS server (aiohttp, async).

    env = ORSEnvironment(ORSOptions(url="http://127.0.0.1:8080", env_name="gsm8k"))
    session = await env.open(await env.get_task("train", 0))

In a run config: `env.name = "ors"` with `env.options = {url = "...", env_name = "...", ...}`.

It speaks the wire protocol of both official SDKs (ors-sdk, openreward) and of plait's own server:
SSE results (`task_id` / `chunk` / `end` / `error`), resuming a dropped `/call` stream with its
`task_id`, a keep-alive `POST /ping` every `ping_interval_s`, retries with exponential back-off
that honour `Retry-After` (429, 502, 503 — also the 503 "starting" answer while setup runs — 504
and connection errors), and fall-backs for older servers (`/task_tools` -> `/tools`,
`/messages` -> `/prompt`, secrets in the body for servers without `/version`). It also enforces
the finished latch itself, because ors-sdk servers do not. Session ids are made here (the
protocol leaves them to the client), and plait's servers answer `/create` with the session's
messages and tools (`X-Plait-Include`, which other servers ignore), so a one-turn episode costs
three requests there (/create, /call, /delete) and five elsewhere (/messages and /task_tools too).
A 409 answering a retried /create means the first attempt made the session.

The HTTP client is aiohttp rather than httpx: measured against plait's own server, httpx spent
13 ms of CPU per episode, aiohttp 2.5 ms.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import email.utils
import functools
import json
import os
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import attrs
import certifi
import structlog

from plait.api import Block, EnvironmentError_, Message, Split, ToolError, ToolOutput, ToolSpec
from plait_sdk import sse
from plait_sdk.types import (
    INCLUDABLE,
    INCLUDE_HEADER,
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

# What a dropped connection, a refused one or a silent server raises: worth a retry.
TransportError = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


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
    """Longest silence on an SSE stream (the server pings every 10 s) before it counts as
    dropped."""
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


@attrs.frozen
class _Answer:
    """A whole non-streamed HTTP answer."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def detail(self) -> str:
        try:
            data = json.loads(self.body)
        except ValueError:
            return self.body[:500].decode(errors="replace")
        return str(data.get("detail", data)) if isinstance(data, dict) else str(data)[:500]


async def _read(response: aiohttp.ClientResponse) -> _Answer:
    return _Answer(response.status, response.headers, await response.read())


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The body's lines as they arrive. Split here rather than by aiohttp's readline, which
    refuses lines past its buffer size; a server may send a long result as one `data:` line."""
    pending = b""
    async for chunk in response.content.iter_any():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode()
    if pending:
        yield pending.decode()


class ORSEnvironment:
    """The core `Environment` protocol over HTTP to an ORS server."""

    def __init__(self, options: ORSOptions) -> None:
        self.options = options
        self.url = options.url.rstrip("/")
        self.api_key = (
            options.api_key if options.api_key is not None else os.environ.get("ORS_API_KEY")
        )
        self.name = options.env_name or "ors"
        self._env_name: str | None = options.env_name.lower() if options.env_name else None
        self.http = _HTTP(options.request_timeout_s)
        self._has_version: bool | None = None
        # Optional routes this server turned out to lack (404), remembered for every later session:
        # ors-sdk servers have no /messages, and asking each session again costs a request.
        self.missing_routes: set[str] = set()

    @classmethod
    def from_options(cls, *, options: ORSOptions) -> ORSEnvironment:
        return cls(options)

    # -- HTTP --------------------------------------------------------------------------------

    def headers(
        self, sid: str | None = None, extra: Mapping[str, str] | None = None
    ) -> dict[str, str]:
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

    async def request(
        self,
        method: str,
        path: str,
        *,
        sid: str | None = None,
        body: Any = None,
        extra_headers: Mapping[str, str] | None = None,
        conflict_after_retry: Any = None,
    ) -> Any:
        """One JSON request with retries; raises ServerError with the server's own message.
        A 409 answering a retry returns `conflict_after_retry` when given: an earlier attempt,
        whose answer was lost, did what was asked."""
        attempt = 0
        started = time.monotonic()
        while True:
            try:
                async with self.http.client().request(
                    method, self.url + path, json=body, headers=self.headers(sid, extra_headers)
                ) as response:
                    answer = await _read(response)
            except TransportError as exc:
                failure: str = f"{type(exc).__name__}: {exc}"
                retry_after = None
            else:
                if answer.status < 400:
                    return answer.json()
                if answer.status == 409 and attempt and conflict_after_retry is not None:
                    return conflict_after_retry
                failure = f"HTTP {answer.status}: {answer.detail()}"
                retry_after, starting = self._retryable(method, path, answer, started)
                if starting:
                    attempt = min(attempt, 1)
            attempt += 1
            if attempt > self.options.max_retries:
                raise ServerError(
                    f"ORS server {self.url} failed {method} {path} {attempt} times; "
                    f"last: {failure}",
                    0,
                    fix="check that the server runs and is reachable",
                )
            log.debug("retrying", method=method, path=path, attempt=attempt, failure=failure)
            await self._backoff(attempt, retry_after)

    def _retryable(
        self, method: str, path: str, answer: _Answer, started: float
    ) -> tuple[float | None, bool]:
        """For a failed answer worth retrying: its Retry-After, and whether the server is only
        starting (a 503 within setup_timeout_s: waited out, not counted as a failure). Raises
        ServerError for one that is not worth retrying."""
        if answer.status not in RETRY_STATUSES:
            raise self._error(method, path, answer.status, answer.detail())
        starting = (
            answer.status == 503 and time.monotonic() - started < self.options.setup_timeout_s
        )
        return retry_after_seconds(answer.headers.get("retry-after")), starting

    def _error(self, method: str, path: str, status: int, detail: str) -> ServerError:
        fix = None
        if status == 401:
            fix = "set the server's API key (options.api_key or ORS_API_KEY)"
        elif status == 404 and "environment" in detail:
            fix = "check options.env_name against the server's GET /list_environments"
        return ServerError(
            f"ORS server {self.url}: {method} {path} answered {status}: {detail}", status, fix=fix
        )

    async def stream(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        sid: str | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> str:
        """POST an SSE endpoint and return the joined result text; resumes a dropped stream."""
        task_id: str | None = None
        attempt = 0
        started = time.monotonic()
        # no limit on the whole call (a tool may run for long), only on silence between pings
        timeout = aiohttp.ClientTimeout(
            total=None, connect=10.0, sock_read=self.options.heartbeat_timeout_s
        )
        while True:
            payload = dict(body)
            if task_id is not None:
                payload["task_id"] = task_id
            retry_after = None
            try:
                async with self.http.client().post(
                    self.url + path,
                    json=payload,
                    timeout=timeout,
                    headers=self.headers(sid, extra_headers),
                ) as response:
                    if response.status >= 400:
                        answer = await _read(response)
                        failure = f"HTTP {answer.status}: {answer.detail()}"
                        retry_after, starting = self._retryable("POST", path, answer, started)
                        if starting:
                            attempt = min(attempt, 1)
                    elif "text/event-stream" not in response.headers.get("content-type", ""):
                        data = json.loads(await response.read() or b"null")
                        return json.dumps(
                            data
                        )  # a server that answers plain JSON (the spec's docs do)
                    else:
                        pieces: list[str] = []
                        async for name, data in sse.parse_events(_lines(response)):
                            if name == "task_id":
                                task_id = data.strip()
                            elif name == "chunk":
                                pieces.append(data)
                            elif name == "end":
                                pieces.append(data)
                                return "".join(pieces)
                            elif name == "error":
                                raise _RemoteToolError(
                                    data or "the server reported an error without a message"
                                )
                        failure = "the stream ended before its end event"
            except TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            attempt += 1
            if attempt > self.options.max_retries:
                raise ServerError(
                    f"ORS server {self.url}: POST {path} failed {attempt} times; last: {failure}",
                    0,
                    fix="check that the server runs and is reachable",
                )
            log.debug(
                "stream dropped; resuming" if task_id else "retrying",
                path=path,
                attempt=attempt,
                failure=failure,
            )
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
            raise EnvironmentError_(
                f"ORS environment {self.name!r} has no split(s) {missing}; "
                f"it has {sorted(by_name)}",
                fix="fix env.options.splits",
            )
        return [by_name[n] for n in self.options.splits]

    async def _check_split(self, split: str) -> None:
        if self.options.splits and split not in self.options.splits:
            raise KeyError(f"split {split!r} is not among env.options.splits {self.options.splits}")

    async def num_tasks(self, split: str) -> int:
        await self._check_split(split)
        return int(
            (await self.request("POST", await self.path("num_tasks"), body={"split": split}))[
                "num_tasks"
            ]
        )

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        await self._check_split(split)
        if index < 0:
            raise IndexError(f"task index {index} is negative")
        try:
            answer = await self.request(
                "POST", await self.path("task"), body={"split": split, "index": index}
            )
        except ServerError as exc:
            if exc.status == 400:
                raise IndexError(exc.message) from exc
            raise
        return dict(answer["task"])

    # -- sessions ----------------------------------------------------------------------------

    async def open(
        self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None
    ) -> ORSSession:
        # ORS session ids are the client's to choose (/create_session only hands out a uuid4):
        # making one here saves an SSE round trip per episode.
        sid = uuid.uuid4().hex
        body: dict[str, Any] = {"env_name": await self.env_name(), "task_spec": dict(task)}
        extra: dict[str, str] = {}
        if secrets:
            if await self.has_version_route():
                extra["X-Secrets"] = secrets_header(secrets)
            else:  # ors-sdk's server reads secrets from the body only
                body["secrets"] = dict(secrets)
        # plait's servers answer with the session's messages and tools too (others ignore the
        # header)
        extra[INCLUDE_HEADER] = ",".join(INCLUDABLE)
        session = ORSSession(self, sid)
        try:
            # the id is this call's own (a fresh uuid4): a 409 answering a retry means an earlier
            # attempt made the session, its answer lost (e.g. timed out waiting for a slow setup)
            created = await self.request(
                "POST",
                "/create",
                sid=sid,
                body=body,
                extra_headers=extra,
                conflict_after_retry={"sid": sid},
            )
            if isinstance(created, Mapping):
                session.take_included(created)
        except BaseException:
            await session.close()
            raise
        session.start_pinging()
        return session

    async def close(self) -> None:
        await self.http.close()


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One TLS context for every client: building one loads the CA bundle (tens of ms)."""
    return ssl.create_default_context(cafile=certifi.where())


class _HTTP:
    """An aiohttp client session for the running event loop (made anew when the loop changes),
    shared by the environment and all its sessions: one pool of keep-alive connections."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._client: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            # No connection limit: every running episode may have a call in flight at once. No
            # trust_env: it reads ~/.netrc and the proxy variables in a thread on every request.
            self._client = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ssl=_ssl_context()),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, connect=10.0),
            )
            self._loop = loop
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            with contextlib.suppress(
                RuntimeError
            ):  # its event loop is gone; the sockets went with it
                await client.close()


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
        self._first_messages: list[Message] | None = None  # from /create, for the first messages()
        self._pinger: asyncio.Task[None] | None = None

    def take_included(self, created: Mapping[str, Any]) -> None:
        """Keep what a plait server's /create added (X-Plait-Include), sparing those round trips."""
        if isinstance(created.get("messages"), list):
            self._first_messages = [message_from_wire(m) for m in created["messages"]]
        if isinstance(created.get("task_tools"), Mapping):
            self._take_listing(created["task_tools"])

    async def _request(self, method: str, path: str) -> Any:
        return await self.env.request(method, path, sid=self.sid)

    async def _stream(self, suffix: str, body: Mapping[str, Any]) -> str:
        return await self.env.stream(await self.env.path(suffix), body, sid=self.sid)

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
        return [
            block_from_wire(b) for b in await self._request("GET", await self.env.path("prompt"))
        ]

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
        if self._first_messages is not None:
            first, self._first_messages = self._first_messages, None
            return first
        found = await self._optional_route("messages")
        if found is not None:
            return [message_from_wire(m) for m in found]
        return prompt_as_messages(await self.prompt())

    async def _list_tools(self) -> None:
        listing = await self._optional_route("task_tools")
        if listing is None:
            listing = await self._request("GET", await self.env.path("tools"))
        self._take_listing(listing)

    def _take_listing(self, listing: Mapping[str, Any]) -> None:
        self._tools = [tool_spec_from_wire(t) for t in listing.get("tools") or []]
        terminal = listing.get("terminal_tool")
        self._terminal = None
        if isinstance(terminal, Mapping) and isinstance(terminal.get("name"), str):
            self._terminal = terminal_tool_to_spec(
                TerminalToolSpec(
                    name=terminal["name"],
                    arg=terminal.get("arg"),
                    description=str(terminal.get("description") or ""),
                )
            )

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
            return ToolError(
                f"{name!r} was not run: the episode has finished (a tool returned finished=True)",
                "episode_finished",
            )
        if self.lost:
            return ToolError(
                f"{name!r} was not run: the server lost the session ({self.lost})", "exception"
            )
        if not isinstance(input, Mapping):
            return ToolError(
                f"tool input must be a JSON object, got {type(input).__name__}", "input_validation"
            )
        self._first_messages = None  # a call may change what the session's messages are
        try:
            text = await self._stream("call", {"name": name, "input": dict(input)})
            result = run_tool_result_from_wire(json.loads(text))
        except _RemoteToolError as exc:
            return ToolError(f"tool {name!r} failed on the server: {exc}", "exception")
        except ServerError as exc:
            return ToolError(f"tool {name!r} could not be called: {exc.message}", "exception")
        except (ValueError, aiohttp.ClientError) as exc:
            return ToolError(
                f"tool {name!r}: the server's answer could not be read: "
                f"{type(exc).__name__}: {exc}",
                "exception",
            )
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
                    # /delete_session does nothing on the server (ORS); only servers without
                    # /delete need it
                    break
            except (ServerError, aiohttp.ClientError, RuntimeError) as exc:
                # already gone, or a server without the route: closing must never fail the caller
                log.debug("ORS close step failed", path=path, sid=self.sid, error=str(exc))


def _route_missing(exc: ServerError) -> bool:
    """A 404 for a route an older server lacks (not for a missing session or environment)."""
    return exc.status == 404 and ("Not Found" in exc.message or "no endpoint" in exc.message)
