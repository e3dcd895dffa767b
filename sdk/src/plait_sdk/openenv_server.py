"""Any plait environment as an OpenEnv server: `plait env serve --protocol openenv NAME`
(needs `pip install 'plait-sdk[openenv]'`, for uvicorn's WebSocket support).

OpenEnv's own clients (`openenv.core.EnvClient`, `GenericEnvClient`) run episodes over `/ws`
(`plait_sdk.openenv` shows the wire); each WebSocket is one episode at a time:

- `reset` picks a task: `split` (default the server's), then `index`, else `seed` modulo the
  split's size, else a random one; the observation is `{"text": the prompt, "messages": the
  opening chat messages, "tools": the tools beside the plain reply}`;
- `step` takes `{"message": reply}` (the model's plain reply, passed to the terminal tool) or
  `{"tool": name, "arguments": {...}}` (one tool call); its observation's `text` is the tool's
  output, `reward` its reward and `done` says the episode ended (a plain reply ends it unless the
  environment hands the turn back, as in plait's rollout);
- `state` gives the episode id, step count, split and index; `close` ends the session.

HTTP: GET /health, /metadata, /schema and /state, and POST /reset and /step, which (as in
OpenEnv) each run on a fresh episode that is closed after the answer. There is no MCP (/mcp) and no
web UI. A tool that raises is answered with an EXECUTION_ERROR, as OpenEnv answers an environment
that raises.
"""

from __future__ import annotations

import contextlib
import json
import random
import uuid
from collections.abc import Mapping
from typing import Any

import structlog

from plait.api import (
    ROLE_KEY,
    Environment as EnvironmentProtocol,
    EnvSession,
    PlaitError,
    ToolError,
    ToolSpec,
    blocks_text,
)
from plait_sdk.openenv import require_websockets

log = structlog.get_logger("plait_sdk.openenv_server")

ACTION_SCHEMA = {
    "title": "PlaitAction",
    "type": "object",
    "description": "Either message (the model's plain reply) or tool with arguments.",
    "properties": {
        "message": {"type": "string", "description": "The model's reply"},
        "tool": {"type": "string", "description": "A tool to call instead of replying"},
        "arguments": {"type": "object", "description": "The tool's input"},
        "metadata": {"type": "object"},
    },
    "additionalProperties": False,
}
OBSERVATION_SCHEMA = {
    "title": "PlaitObservation",
    "type": "object",
    "properties": {
        "text": {"type": "string"},
        "messages": {"type": "array", "items": {"type": "object"}},
        "tools": {"type": "array", "items": {"type": "object"}},
        "done": {"type": "boolean"},
        "reward": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "metadata": {"type": "object"},
    },
}
STATE_SCHEMA = {
    "title": "PlaitState",
    "type": "object",
    "properties": {
        "episode_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "step_count": {"type": "integer", "minimum": 0},
        "split": {"type": "string"},
        "index": {"type": "integer"},
        "done": {"type": "boolean"},
    },
}


class _Refused(Exception):
    """A request the client got wrong: answered with `code`, the session goes on."""

    def __init__(self, message: str, code: str = "VALIDATION_ERROR") -> None:
        super().__init__(message)
        self.code = code


def _result(observation: dict[str, Any], reward: float | None, done: bool) -> dict[str, Any]:
    return {"observation": observation, "reward": reward, "done": done}


def _tool_wire(spec: ToolSpec) -> dict[str, Any]:
    return {"name": spec.name, "description": spec.description, "input_schema": spec.input_schema}


class _Episode:
    """One plait session behind one OpenEnv episode."""

    def __init__(self, session: EnvSession, split: str, index: int) -> None:
        self.session = session
        self.split = split
        self.index = index
        self.episode_id = str(uuid.uuid4())
        self.step_count = 0
        self.done = False
        self.terminal: ToolSpec | None = None

    async def first(self) -> dict[str, Any]:
        self.terminal = await self.session.terminal_tool()
        messages = await self.session.messages()
        tools = await self.session.tools()
        observation = {
            "text": blocks_text(await self.session.prompt()),
            "messages": [{"role": m.role, "content": m.content} for m in messages],
            "tools": [_tool_wire(t) for t in tools],
        }
        return _result(observation, None, False)

    async def step(self, action: Any) -> dict[str, Any]:
        if not isinstance(action, Mapping):
            raise _Refused(f"an action is a JSON object, got {type(action).__name__}")
        unknown = sorted(set(action) - set(ACTION_SCHEMA["properties"]))  # type: ignore[call-overload]
        if unknown:
            raise _Refused(
                f"unknown action field {', '.join(unknown)}; an action is "
                '{"message": reply} or {"tool": name, "arguments": {...}}'
            )
        message, tool = action.get("message"), action.get("tool")
        if (message is None) == (tool is None):
            raise _Refused('give exactly one of "message" (a reply) and "tool" (a tool call)')
        if message is not None:
            if not isinstance(message, str):
                raise _Refused('"message" must be a string')
            if self.terminal is None:
                raise _Refused(
                    "this environment takes no plain replies (it has no terminal tool); call "
                    'one of its tools with {"tool": name, "arguments": {...}}'
                )
            props = list((self.terminal.input_schema or {}).get("properties", {}))
            name, arguments = self.terminal.name, {props[0]: message} if props else {}
        else:
            arguments = action.get("arguments") or {}
            if not isinstance(tool, str) or not isinstance(arguments, Mapping):
                raise _Refused('"tool" must be a string and "arguments" an object')
            name = tool
        output = await self.session.call(name, arguments)
        self.step_count += 1
        if isinstance(output, ToolError):
            if output.reason == "exception":
                raise _Refused(f"tool {name!r} failed: {output.error}", "EXECUTION_ERROR")
            self.done = self.done or output.reason == "episode_finished"
            return _result(
                {"text": f"error: {output.error}", "error": output.reason}, None, self.done
            )
        handed_back = ROLE_KEY in (output.metadata or {})
        # a plain reply ends the episode unless the environment hands the turn back (rollout.py)
        self.done = output.finished or (message is not None and not handed_back)
        return _result({"text": output.text}, output.reward, self.done)

    def state(self) -> dict[str, Any]:
        return {
            "episode_id": self.episode_id,
            "step_count": self.step_count,
            "split": self.split,
            "index": self.index,
            "done": self.done,
        }


class OpenEnvServer:
    """Serves one plait environment over OpenEnv's HTTP + WebSocket wire (an ASGI app)."""

    def __init__(self, env: Any, *, split: str = "train", max_sessions: int = 64) -> None:
        from plait_sdk.server import _as_protocol_env

        self.env: EnvironmentProtocol = _as_protocol_env(env)
        self.split = split
        self.max_sessions = max_sessions
        self.active = 0
        self.rng = random.Random()

        async def app(scope: Any, receive: Any, send: Any) -> None:
            await self.asgi(scope, receive, send)

        # a plain coroutine function, which uvicorn recognises as ASGI 3 (a bound method it takes
        # for ASGI 2)
        self.app = app

    # -- episodes ------------------------------------------------------------------------------

    async def _open(self, data: Mapping[str, Any]) -> _Episode:
        split = data.get("split", self.split)
        names = [s.name for s in await self.env.splits()]
        if split not in names:
            raise _Refused(f"environment {self.env.name!r} has no split {split!r}; it has {names}")
        total = await self.env.num_tasks(split)
        if total == 0:
            raise _Refused(f"split {split!r} of environment {self.env.name!r} has no tasks")
        index, seed = data.get("index"), data.get("seed")
        for key, value in (("index", index), ("seed", seed)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise _Refused(f"reset {key} must be an integer, got {value!r}")
        if index is None:
            index = seed % total if seed is not None else self.rng.randrange(total)
        if not 0 <= index < total:
            raise _Refused(f"task index {index} is out of range for split {split!r} ({total})")
        task = await self.env.get_task(split, index)
        try:
            session = await self.env.open(task)
        except PlaitError as exc:
            raise _Refused(str(exc), "EXECUTION_ERROR") from None
        return _Episode(session, split, index)

    # -- the ASGI application ------------------------------------------------------------------

    async def asgi(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await self.env.close()
            await send({"type": "lifespan.shutdown.complete"})
        elif scope["type"] == "websocket":
            if scope["path"].rstrip("/") != "/ws":
                await send({"type": "websocket.close", "code": 1008})
                return
            await self._websocket(receive, send)
        else:
            await self._http(scope, receive, send)

    async def _websocket(self, receive: Any, send: Any) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})

        async def answer(kind: str, data: dict[str, Any]) -> None:
            await send({"type": "websocket.send", "text": json.dumps({"type": kind, "data": data})})

        if self.active >= self.max_sessions:  # as OpenEnv: say so, then close
            await answer(
                "error",
                {
                    "message": f"server at capacity ({self.max_sessions} sessions)",
                    "code": "CAPACITY_REACHED",
                    "active_sessions": self.active,
                    "max_sessions": self.max_sessions,
                },
            )
            await send({"type": "websocket.close", "code": 1000})
            return
        self.active += 1
        episode: _Episode | None = None
        try:
            while True:
                event = await receive()
                if event["type"] == "websocket.disconnect":
                    break
                raw = event.get("text") or (event.get("bytes") or b"").decode(errors="replace")
                try:
                    message = json.loads(raw)
                except ValueError as exc:
                    await answer(
                        "error", {"message": f"Invalid JSON: {exc}", "code": "INVALID_JSON"}
                    )
                    continue
                kind = message.get("type") if isinstance(message, dict) else None
                if kind == "close":
                    break
                try:
                    if kind == "reset":
                        if episode is not None:
                            await episode.session.close()
                            episode = None
                        episode = await self._open(message.get("data") or {})
                        await answer("observation", await episode.first())
                    elif kind in ("step", "state") and episode is None:
                        raise _Refused(f"{kind} before reset: reset first, which picks the task")
                    elif kind == "step" and episode is not None:
                        await answer("observation", await episode.step(message.get("data")))
                    elif kind == "state" and episode is not None:
                        await answer("state", episode.state())
                    else:
                        raise _Refused(f"Unknown message type: {kind}", "UNKNOWN_TYPE")
                except _Refused as exc:
                    await answer("error", {"message": str(exc), "code": exc.code})
                except Exception as exc:  # the environment's bug costs this request, not the server
                    log.warning("OpenEnv request failed", kind=kind, error=repr(exc))
                    await answer(
                        "error",
                        {"message": f"{type(exc).__name__}: {exc}", "code": "EXECUTION_ERROR"},
                    )
        finally:
            self.active -= 1
            if episode is not None:
                await episode.session.close()
            with contextlib.suppress(Exception):  # the client may be gone already
                await send({"type": "websocket.close", "code": 1000})

    async def _http(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            event = await receive()
            body += event.get("body", b"")
            if not event.get("more_body"):
                break
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        try:
            status, answer = await self._route(method, path, body)
        except _Refused as exc:
            status, answer = 422, {"detail": str(exc)}
        except Exception as exc:
            log.warning("OpenEnv HTTP request failed", path=path, error=repr(exc))
            status, answer = 500, {"detail": f"{type(exc).__name__}: {exc}"}
        payload = json.dumps(answer).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(payload)),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        gets = {
            "/health": lambda: {"status": "healthy"},
            "/metadata": lambda: {
                "name": self.env.name,
                "description": f"plait environment {self.env.name!r}, served over OpenEnv by "
                "plait-sdk",
            },
            "/schema": lambda: {
                "action": ACTION_SCHEMA,
                "observation": OBSERVATION_SCHEMA,
                "state": STATE_SCHEMA,
            },
            "/state": lambda: {"episode_id": None, "step_count": 0},
        }
        if method == "GET" and path in gets:
            return 200, gets[path]()
        if method == "POST" and path in ("/reset", "/step"):
            try:
                data = json.loads(body or b"{}")
            except ValueError as exc:
                raise _Refused(f"the body is not JSON: {exc}") from None
            if not isinstance(data, dict):
                raise _Refused("the body must be a JSON object")
            # as in OpenEnv, each request gets a fresh episode: only /ws keeps one going
            episode = await self._open(data)
            try:
                first = await episode.first()
                return 200, first if path == "/reset" else await episode.step(data.get("action"))
            finally:
                await episode.session.close()
        routes = ", ".join([*(f"GET {p}" for p in gets), "POST /reset", "POST /step", "WS /ws"])
        return 404, {"detail": f"no route {method} {path}; this server has {routes}"}

    def run(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        """Serve until interrupted, on loopback only: OpenEnv's wire has no authentication."""
        import uvicorn

        from plait_sdk.server import is_loopback

        require_websockets("plait env serve --protocol openenv")
        if not is_loopback(host):
            raise PlaitError(
                f"refusing to serve OpenEnv on {host}: OpenEnv's wire has no API key, so anyone "
                "who reaches the port could run episodes",
                fix="serve on 127.0.0.1 (behind an authenticating proxy if it must be reached "
                "from elsewhere), or use --protocol ors with --api-key",
            )
        log.info("serving OpenEnv", url=f"http://{host}:{port}", environment=self.env.name)
        uvicorn.run(self.app, host=host, port=port, log_level="warning")
