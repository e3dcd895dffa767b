"""OpenEnv environments in plait: env.name = "openenv" (needs `pip install 'plait-sdk[openenv]'`).

Drives any OpenEnv (openenv-core) server over its WebSocket (`plait_sdk.openenv` shows the wire),
so episode state lives where OpenEnv keeps it. The server is reached by `url`, or started here:
`app = "module:app"` runs `python -m uvicorn module:app` on a free loopback port (in `app_dir`,
with `python`, default this interpreter), and `command` runs any argv whose `{port}` is replaced.
A started server lives from the first episode until the environment is closed.

- a task is a seed (`splits`: split name -> seeds); the episode's `reset` carries it (plus
  `reset_extra`), and the reset observation is the prompt;
- the model's plain reply goes to the terminal tool `reply`, which sends one `step` whose action is
  `{action_field: reply, **action_extra}`; OpenEnv actions are typed, so the action schema
  (`GET /schema`) is checked against these options before the first episode;
- the step's `reward` is the reply's reward, and `done` ends the episode; until then the turn goes
  back to the model with the observation as a user message, as for skyrl-gym environments.

The server is the environment: a refused connection, an error answer, a connection that drops
mid-episode or a reward that is not a number costs that episode as an environment error.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import math
import socket
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import structlog

from plait.api import (
    ROLE_KEY,
    EnvironmentError_,
    Message,
    Split,
    TextBlock,
    ToolError,
    ToolOutput,
    ToolSpec,
    positive,
)
from plait_sdk.openenv import require_websockets
from plait_sdk.types import SPLIT_TYPES

log = structlog.get_logger("plait_sdk.openenv_client")

NAME = "openenv"
CAPACITY_CODE = "CAPACITY_REACHED"


@attrs.frozen(kw_only=True)
class OpenEnvOptions:
    """Options of `openenv`: where the server is (exactly one of url, app, command), how a reply
    becomes an action, and how an observation becomes text."""

    url: str | None = None
    """A running OpenEnv server, e.g. http://localhost:8000 (ws:// works too)."""
    app: str | None = None
    """"module:app" (the ASGI app `create_app` made), run with uvicorn by `python`."""
    app_dir: str | None = None
    """Where `app` is imported from (its working directory); default the current one."""
    python: str = sys.executable
    """The interpreter that runs `app` (e.g. a venv's bin/python that has openenv-core)."""
    command: list[str] = attrs.field(factory=list)
    """Any command that serves OpenEnv on 127.0.0.1:{port} ({port} is replaced by a free port)."""
    action_field: str = "message"
    """The action's field that gets the model's reply."""
    action_extra: dict[str, Any] = attrs.field(factory=dict)
    """Fixed fields added to every action."""
    observation_field: str | None = None
    """The observation's field shown to the model; default its only non-empty text field, or
    else the whole observation as JSON."""
    messages_field: str | None = None
    """An observation field holding the opening chat messages (`[{role, content}, ...]`), which
    the model is then shown as they are instead of the observation's text: `"messages"` for
    `plait env serve --protocol openenv`, whose environments open with a system prompt or
    earlier turns."""
    instructions: str = ""
    """Put before the reset observation in the prompt (as a system message with
    `messages_field`)."""
    splits: dict[str, list[int]] = attrs.field(
        factory=lambda: {"train": list(range(1000)), "test": list(range(1000, 1100))}
    )
    """Split name -> the seeds its episodes reset with."""
    reset_extra: dict[str, Any] = attrs.field(factory=dict)
    """Fixed fields added to every reset (the environment's reset keyword arguments)."""
    split_reset: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    """Per split, more reset fields: for a server with splits of its own, such as `plait env
    serve --protocol openenv`, `{ test = { split = "test" } }` keeps held-out seeds held out."""
    start_timeout_s: float = attrs.field(default=120.0, validator=positive)
    message_timeout_s: float = attrs.field(default=300.0, validator=positive)
    """Longest wait for the answer to one reset or step."""
    capacity_wait_s: float = attrs.field(default=600.0, validator=positive)
    """How long an episode waits for a session while the server is at `max_concurrent_envs`."""

    def __attrs_post_init__(self) -> None:
        given = [k for k in ("url", "app", "command") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of url (a running server), app ('module:app') or command "
                f"(an argv with {{port}}); got {', '.join(given) or 'none'}"
            )
        if self.url and urllib.parse.urlsplit(self.url).scheme not in (
            "http",
            "https",
            "ws",
            "wss",
        ):
            raise ValueError(f"url: {self.url!r} is not an http(s):// or ws(s):// URL")
        if self.app and ":" not in self.app:
            raise ValueError(f"app: {self.app!r} is not 'module:attribute', e.g. 'server.app:app'")
        if self.command and not any("{port}" in arg for arg in self.command):
            raise ValueError("command: no {port} in it; the server must listen where plait looks")
        if self.app_dir and not Path(self.app_dir).is_dir():
            raise ValueError(f"app_dir: no directory {self.app_dir!r}")
        if not self.action_field:
            raise ValueError("action_field: must name the action's text field, e.g. 'message'")
        if self.action_field in self.action_extra:
            raise ValueError(
                f"action_extra.{self.action_field}: that field gets the reply (action_field)"
            )
        if not self.splits or not all(self.splits.values()):
            raise ValueError("splits: give each split at least one seed, e.g. { train = [0, 1] }")
        for split in self.split_reset:
            if split not in self.splits:
                raise ValueError(
                    f"split_reset.{split}: no such split in splits {sorted(self.splits)}"
                )
        require_websockets(f'environment "{NAME}"')


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _is_loopback(url: str) -> bool:
    return (urllib.parse.urlsplit(url).hostname or "") in ("localhost", "127.0.0.1", "::1")


class _Launched:
    """A server process started from `app` or `command`, its output kept in a file for errors."""

    def __init__(self, options: OpenEnvOptions) -> None:
        self.port = _free_port()
        if options.app:
            argv = [options.python, "-m", "uvicorn", options.app, "--host", "127.0.0.1"]
            argv += ["--port", str(self.port)]
        else:
            argv = [arg.replace("{port}", str(self.port)) for arg in options.command]
        self.argv = argv
        self.cwd = options.app_dir
        self.url = f"http://127.0.0.1:{self.port}"
        self.output = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            prefix="plait-openenv-", suffix=".log"
        )
        self.process: asyncio.subprocess.Process | None = None
        atexit.register(self.kill)

    def tail(self, lines: int = 15) -> str:
        self.output.flush()
        text = Path(self.output.name).read_text(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:]) or "(no output)"

    async def start(self, timeout_s: float) -> None:
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv, cwd=self.cwd, stdout=self.output, stderr=asyncio.subprocess.STDOUT
            )
        except OSError as exc:
            raise EnvironmentError_(
                f'environment "{NAME}": could not start {self.argv[0]!r}: {exc}',
                fix="check env.options.python / env.options.command",
            ) from None
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession(trust_env=False) as http:
            while True:
                if self.process.returncode is not None:
                    raise EnvironmentError_(
                        f'environment "{NAME}": the OpenEnv server {" ".join(self.argv)!r} '
                        f"exited with status {self.process.returncode} before it served; its "
                        f"output:\n{self.tail()}",
                        fix="run the command by hand to see why (is openenv-core installed for "
                        "that python, is the app's module importable from app_dir?)",
                    )
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with http.get(
                        f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=2)
                    ) as answer:
                        if answer.status == 200:
                            return
                if time.monotonic() > deadline:
                    self.kill()
                    raise EnvironmentError_(
                        f'environment "{NAME}": the OpenEnv server {" ".join(self.argv)!r} did '
                        f"not answer GET /health within {timeout_s:g} s; its output:\n"
                        f"{self.tail()}",
                        fix="raise env.options.start_timeout_s, or check that it listens on "
                        "127.0.0.1:{port}",
                    )
                await asyncio.sleep(0.1)

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()

    async def stop(self) -> None:
        atexit.unregister(self.kill)
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.kill()
                await self.process.wait()
        self.output.close()


class _ServerSaidError(Exception):
    def __init__(self, data: Mapping[str, Any]) -> None:
        self.code = str(data.get("code", "UNKNOWN"))
        super().__init__(f"{data.get('message', 'no message')} (code {self.code})")


class _BadAnswer(Exception):
    """The server's answer is not what OpenEnv's wire says it is."""


def _reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool | int | float) and math.isfinite(float(value)):
        return float(value)
    raise _BadAnswer(
        f"the step's reward is {value!r} ({type(value).__name__}); OpenEnv rewards are a finite "
        "number or null"
    )


class OpenEnvEnvironment:
    """An OpenEnv server as a plait environment: tasks are seeds, the reply is the action."""

    def __init__(self, options: OpenEnvOptions) -> None:
        self.options = options
        self.name = NAME
        self._launched: _Launched | None = None
        self._ready: asyncio.Lock | None = None
        self._base_url: str | None = options.url.rstrip("/") if options.url else None
        self._checked = False

    @classmethod
    def from_options(cls, *, options: OpenEnvOptions) -> OpenEnvEnvironment:
        return cls(options)

    async def splits(self) -> list[Split]:
        return [Split(n, n if n in SPLIT_TYPES else "validation") for n in self.options.splits]

    def _seeds(self, split: str) -> list[int]:
        if split not in self.options.splits:
            raise KeyError(
                f'environment "{NAME}" has no split {split!r}; it has '
                f"{sorted(self.options.splits)} (env.options.splits)"
            )
        return self.options.splits[split]

    async def num_tasks(self, split: str) -> int:
        return len(self._seeds(split))

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        seeds = self._seeds(split)
        if not 0 <= index < len(seeds):
            raise IndexError(
                f"task index {index} is out of range for split {split!r} ({len(seeds)} tasks)"
            )
        return {"seed": seeds[index], "split": split}

    async def _base(self) -> str:
        """The server's base URL, starting it (and checking its action schema) the first time."""
        if self._ready is None:
            self._ready = asyncio.Lock()
        async with self._ready:
            if self._base_url is None:
                launched = _Launched(self.options)
                await launched.start(self.options.start_timeout_s)
                self._launched, self._base_url = launched, launched.url
                log.info("OpenEnv server started", argv=launched.argv, url=launched.url)
            if not self._checked:
                await self._check_schema(self._base_url)
                self._checked = True
            return self._base_url

    async def _check_schema(self, base: str) -> None:
        http_base = base.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
        try:
            async with (
                aiohttp.ClientSession(trust_env=not _is_loopback(base)) as http,
                http.get(f"{http_base}/schema", timeout=aiohttp.ClientTimeout(total=30)) as answer,
            ):
                schema = (await answer.json())["action"] if answer.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError):
            schema = None  # a server without /schema: the first step will say what is wrong
        if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
            return
        fields = schema["properties"]
        given = {self.options.action_field, *self.options.action_extra}
        unknown = sorted(given - set(fields))
        missing = sorted(set(schema.get("required") or []) - given)
        if unknown or missing:
            problem = (
                f"it has no field {', '.join(unknown)}"
                if unknown
                else f"it requires {', '.join(missing)}, which no option gives"
            )
            raise EnvironmentError_(
                f'environment "{NAME}": the OpenEnv server at {base} takes actions with fields '
                f"{', '.join(sorted(fields))}; {problem}",
                fix="set env.options.action_field to the field that takes the reply and "
                "env.options.action_extra to the other required ones",
            )

    async def open(
        self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None
    ) -> OpenEnvSession:
        seed = task.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f'an {NAME} task is {{"seed": int}}, got {dict(task)!r}')
        base = await self._base()
        session = OpenEnvSession(self, base, dict(task))
        try:
            split_reset = self.options.split_reset.get(task.get("split", ""), {})
            await session.start({**self.options.reset_extra, **split_reset, "seed": seed})
        except BaseException:
            await session.close()
            raise
        return session

    async def close(self) -> None:
        if self._launched is not None:
            launched, self._launched = self._launched, None
            self._base_url, self._checked = None, False
            await launched.stop()


class OpenEnvSession:
    """One episode: one WebSocket, one server-side environment."""

    def __init__(self, owner: OpenEnvEnvironment, base: str, task: dict[str, Any]) -> None:
        self.owner = owner
        self.options = owner.options
        self.base = base
        self.ws_url = _ws_url(base)
        self.task = task
        self.ws: Any = None
        self.prompt_text = ""
        self.prompt_messages: list[Message] = []
        self.finished = False
        self.closed = False
        self.lost: str | None = None
        self._lock = asyncio.Lock()

    async def _connect(self) -> None:
        websockets = require_websockets(f'environment "{NAME}"')
        try:
            self.ws = await websockets.connect(
                self.ws_url,
                open_timeout=self.options.start_timeout_s,
                max_size=100 * 1024 * 1024,  # as OpenEnv's client: observations can be images
                proxy=None if _is_loopback(self.ws_url) else True,
            )
        except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as exc:
            raise EnvironmentError_(
                f'environment "{NAME}": could not open an OpenEnv session at {self.ws_url}: '
                f"{type(exc).__name__}: {exc}",
                fix="check that the server runs and env.options.url points at it (its /ws "
                "route is OpenEnv's session WebSocket)",
            ) from None

    async def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request and its answer's `data`; the server's error answer raises."""
        await self.ws.send(json.dumps(message))
        raw = await asyncio.wait_for(self.ws.recv(), self.options.message_timeout_s)
        try:
            answer = json.loads(raw)
        except ValueError:
            raise _BadAnswer(
                f"the server answered with something that is not JSON: {raw!r:.200}"
            ) from None
        if not isinstance(answer, dict) or not isinstance(answer.get("data"), dict):
            raise _BadAnswer(f"the server's answer has no data object: {raw!r:.200}")
        if answer.get("type") == "error":
            raise _ServerSaidError(answer["data"])
        return dict(answer["data"])

    async def start(self, reset: dict[str, Any]) -> None:
        deadline = time.monotonic() + self.options.capacity_wait_s
        delay = 0.2
        while True:
            await self._connect()
            try:
                result = await self._ask({"type": "reset", "data": reset})
                break
            except _ServerSaidError as exc:
                if exc.code != CAPACITY_CODE or time.monotonic() > deadline:
                    raise EnvironmentError_(
                        f'environment "{NAME}": the OpenEnv server at {self.base} refused to '
                        f"reset with {reset!r}: {exc}",
                        fix="raise the server's max_concurrent_envs (create_app) or "
                        "env.options.capacity_wait_s"
                        if exc.code == CAPACITY_CODE
                        else "check env.options.reset_extra against the environment's reset()",
                    ) from None
            except Exception as exc:
                raise self._lost_error("reset", exc) from None
            # at capacity the server closes the socket: wait for a free session on a new one
            await self._drop()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        try:
            text = self._observation_text(result)
            opening = self._opening_messages(result)
        except _BadAnswer as exc:
            raise EnvironmentError_(f'environment "{NAME}": reset: {exc}') from None
        self.prompt_text = f"{self.options.instructions}\n\n{text}".strip()
        if opening is None:
            self.prompt_messages = [Message("user", self.prompt_text)]
        else:
            instructions = self.options.instructions
            self.prompt_messages = [
                *([Message("system", instructions)] * bool(instructions)),
                *opening,
            ]

    def _lost_error(self, what: str, exc: BaseException) -> EnvironmentError_:
        return EnvironmentError_(
            f'environment "{NAME}": the OpenEnv server at {self.base} failed during {what}: '
            f"{_describe(exc)}",
            fix="see the OpenEnv server's log; plait counts this episode as failed by the "
            "environment",
        )

    def _observation_text(self, result: Mapping[str, Any]) -> str:
        observation = result.get("observation")
        if not isinstance(observation, dict):
            raise _BadAnswer(f"the result has no observation object: {dict(result)!r:.200}")
        field = self.options.observation_field
        if field is not None:
            if field not in observation:
                raise _BadAnswer(
                    f"the observation has no field {field!r} (env.options.observation_field); "
                    f"it has {', '.join(sorted(observation))}"
                )
            value = observation[field]
            return value if isinstance(value, str) else json.dumps(value)
        texts = [v for v in observation.values() if isinstance(v, str) and v]
        if len(texts) == 1:
            return texts[0]
        return json.dumps(observation, sort_keys=True, default=repr)

    def _opening_messages(self, result: Mapping[str, Any]) -> list[Message] | None:
        field = self.options.messages_field
        if field is None:
            return None
        value = result["observation"].get(field)
        if not (
            isinstance(value, list)
            and value
            and all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in value
            )
        ):
            raise _BadAnswer(
                f"the observation's {field!r} (env.options.messages_field) is not a non-empty list "
                f"of {{role, content}} messages: {value!r:.200}"
            )
        return [Message(m["role"], m["content"]) for m in value]

    async def prompt(self) -> list[TextBlock]:
        return [TextBlock(self.prompt_text)]

    async def messages(self) -> list[Message]:
        return list(self.prompt_messages)

    async def tools(self) -> list[ToolSpec]:
        return []

    async def terminal_tool(self) -> ToolSpec:
        return ToolSpec(
            "reply",
            "Your reply: one action of the OpenEnv environment.",
            {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
                "additionalProperties": False,
            },
        )

    async def call(self, name: str, input: Mapping[str, Any]) -> ToolOutput | ToolError:
        if self.closed or self.finished:
            return ToolError(f"{name!r} was not run: the episode has finished", "episode_finished")
        if self.lost:
            return ToolError(f"{name!r} was not run: {self.lost}", "exception")
        if name != "reply":
            return ToolError(f"{name!r} is not a valid tool; the only tool is 'reply'", "not_found")
        text = input.get("text") if isinstance(input, Mapping) else None
        if not isinstance(text, str):
            return ToolError('reply takes {"text": string}', "input_validation")
        action = {**self.options.action_extra, self.options.action_field: text}
        async with self._lock:
            try:
                result = await self._ask({"type": "step", "data": action})
                reward = _reward(result.get("reward"))
                observation = self._observation_text(result)
            except _ServerSaidError as exc:
                return ToolError(
                    f'environment "{NAME}": the OpenEnv server refused the step: {exc}',
                    "exception",
                )
            except _BadAnswer as exc:
                return ToolError(
                    f'environment "{NAME}": the OpenEnv server\'s step answer is unusable: {exc}',
                    "exception",
                )
            except Exception as exc:  # the server (the environment) broke: this episode is lost
                self.lost = str(self._lost_error("step", exc))
                return ToolError(self.lost, "exception")
            self.finished = bool(result.get("done", False))
        metadata: dict[str, Any] = {"done": self.finished}
        if not self.finished:
            metadata[ROLE_KEY] = str(self.task.get(ROLE_KEY, ""))  # the same role goes on
        return ToolOutput(
            blocks=[TextBlock(observation)],
            reward=reward,
            finished=self.finished,
            metadata=metadata,
        )

    async def _drop(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            with contextlib.suppress(Exception):  # closing must never fail the caller
                await ws.close()

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.ws is not None and not self.lost:
            with contextlib.suppress(Exception):  # a dead server has nothing left to close
                await self.ws.send(json.dumps({"type": "close"}))
        await self._drop()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time (env.options.message_timeout_s)"
    if type(exc).__name__.startswith("ConnectionClosed"):
        return f"the connection closed mid-episode (did the server die?): {exc}"
    return f"{type(exc).__name__}: {exc}"


def _ws_url(base: str) -> str:
    parts = urllib.parse.urlsplit(base.rstrip("/"))
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return urllib.parse.urlunsplit((scheme, parts.netloc, f"{parts.path}/ws", "", ""))
