"""Inference engines that live in a server process: launch or attach, and talk HTTP, boundedly.

Engine plugins that drive an HTTP server (vLLM, SGLang) share three things, kept here:

- `ServerProcess` (a `LaunchedServer` on this machine) launches the server's command in its own
  process group, writes its output to a log file, waits for its health endpoint with a deadline
  (failing at once, with the log's last lines, when the process exits during start-up), and stops
  the whole group (SIGTERM, then SIGKILL after a grace period). A server is also stopped when this
  interpreter exits (atexit) and, on Linux, when the process that launched it dies
  (PR_SET_PDEATHSIG), so a crashed run leaves no server behind.
- `EngineHTTP` is a JSON client in which every failure becomes an `EngineError` within a known
  time: unreachable server, a server that crashed (named with its exit code and log tail), a
  request that ran past its deadline, a missing endpoint (an engine version without it), or an
  error status (with the server's message).
- `PauseGate` holds new requests on the client while an engine is paused, so every pause mode
  behaves the same whatever the server does with requests that arrive while it is paused
  (vLLM 0.26 queues them, 0.33 answers 503).
- Small pieces of the wire both engines need: prompt checks, weight-version strings and spans,
  and `WeightStaging`, which writes a `WeightUpdate` as safetensors for the server to load.
- `ServerOptions` and `ServerEngine`: the options and the lifecycle every such engine has
  (launch or attach, lazy health wait, health, close, the pause gate, disk staging, in-flight
  request count, restarts); an engine plugin subclasses both and adds its wire protocol.
- Restarts: a launched server that dies (it exited, or a request failed and it no longer answers
  /health) is launched again with the same command, at most `max_restarts` times per engine;
  requests wait for it, it gets back the weights the dead one had (the last directory they were
  loaded from, the version label, the LoRA adapters), and the requests that were running on the
  dead one are sent once more. An attached server is never restarted.

aiohttp is imported on use of `EngineHTTP`, so importing this module costs nothing. (Not httpx:
a rollout sends a request per sample, and httpx's client cost several times aiohttp's CPU per
request, measured in the controller of a run with its inference engine a service.)
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import structlog

from plait.api import (
    DataError,
    EngineError,
    EngineHealth,
    ModelInput,
    ResolvedModel,
    WeightUpdate,
    positive,
    prompt_token_ids,
)

log = structlog.get_logger("plait_server.engine")
T = TypeVar("T")

_LIVE: weakref.WeakSet[ServerProcess] = weakref.WeakSet()
_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the launching thread's process dies (Linux)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class LaunchedServer:
    """A server an engine started and owns: a process on this machine (`ServerProcess`) or
    elsewhere (a subclass, e.g. one on a Ray node, says where in `location`)."""

    name: str
    log_path: Path
    location = ""
    """Where the process runs, for messages (" on ..."); empty for this machine."""

    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def exit_code(self) -> int | None:
        raise NotImplementedError

    def log_tail(self, lines: int = 30) -> str:
        raise NotImplementedError

    def stop(self, grace_s: float = 15.0) -> None:
        raise NotImplementedError

    def how_it_ended(self) -> str:
        """For messages, once it is not alive: "exited with code 1" (and where it ran)."""
        return f"exited with code {self.exit_code}{self.location}"

    def crash_error(self, what: str = "") -> EngineError:
        return EngineError(
            f"the {self.name} server {self.how_it_ended()}{what}; "
            f"last lines of {self.log_path}:\n{self.log_tail()}",
            fix="read the server log above for the cause",
        )

    async def wait_healthy(
        self, probe: Callable[[], Any], *, timeout_s: float, poll_s: float = 0.5
    ) -> float:
        """Poll `probe()` (an async callable that returns True once the server answers) until it
        does; seconds waited. Stops the server and raises if it exits or the deadline passes."""
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            if not self.alive():
                raise self.crash_error(" while starting")
            with contextlib.suppress(EngineError):
                if await probe():
                    waited = time.monotonic() - start
                    log.info("server healthy", server=self.name, seconds=round(waited, 1))
                    return waited
            if time.monotonic() >= deadline:
                tail = self.log_tail()
                self.stop()
                raise EngineError(
                    f"the {self.name} server{self.location} did not become healthy "
                    f"within {timeout_s:g} s; last lines of {self.log_path}:\n{tail}",
                    fix="raise the engine's startup_timeout_s (a loaded machine starts servers "
                    "slowly), or read the log for the cause",
                )
            await asyncio.sleep(poll_s)


class ServerProcess(LaunchedServer):
    """One server process on this machine (and everything it spawns), with its output in
    `log_path`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log_path: str | Path,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **(env or {})}
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        try:
            self.process = subprocess.Popen(
                self.argv,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            self._log_file.close()
            raise EngineError(
                f"cannot start the {name} server ({self.argv[0]}): {exc}",
                fix="check the server command / python path in the engine options",
            ) from exc
        _LIVE.add(self)
        log.info(
            "server started",
            server=name,
            pid=self.process.pid,
            log=str(self.log_path),
            command=" ".join(self.argv),
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64_000))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 15.0) -> None:
        """Stop the server's whole process group: SIGTERM, then SIGKILL after `grace_s`."""
        if self.alive():
            log.info("stopping server", server=self.name, pid=self.pid)
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("server ignored SIGTERM; killing it", server=self.name, pid=self.pid)
        # Children (e.g. vLLM's engine core) may outlive the leader; the group goes either way.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        self._log_file.close()
        _LIVE.discard(self)

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(grace_s=5.0)


@attrs.frozen
class Reply:
    """A whole HTTP answer (the body read)."""

    status_code: int
    content: bytes
    headers: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


class EngineHTTP:
    """A JSON client for one server; every failure is an `EngineError` within a deadline.

    The underlying aiohttp session belongs to one event loop; a call from another loop (each
    `asyncio.run` makes a new one) gets a fresh session.
    """

    def __init__(
        self,
        base_url: str,
        *,
        name: str,
        timeout_s: float,
        connect_timeout_s: float = 5.0,
        server: LaunchedServer | None = None,
        headers: Mapping[str, str] | None = None,
        keepalive_s: float = 1.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.server = server
        self.headers = dict(headers or {})
        self._client: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop or self._client.closed:
            self._client = aiohttp.ClientSession(
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=None, connect=self.connect_timeout_s),
                # Servers drop idle keep-alive connections (uvicorn after 5 s): reusing one the
                # server is closing loses the request, so let them go sooner (keepalive_s).
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=self.keepalive_s),
            )
            self._loop = loop
        return self._client

    async def _send(
        self, method: str, path: str, json: Any, params: Mapping[str, Any] | None
    ) -> Reply:
        async with self._http().request(
            method, self.base_url + path, json=json, params=params
        ) as response:
            return Reply(response.status, await response.read(), response.headers)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        accept: Sequence[int] = (200,),
    ) -> Reply:
        """Send a request; the whole answer when its status is in `accept`."""
        import aiohttp

        deadline = self.timeout_s if timeout_s is None else timeout_s
        what = f"{method} {path}"
        try:
            response = await asyncio.wait_for(self._send(method, path, json, params), deadline)
        except TimeoutError:
            self._raise_if_crashed(what)
            raise EngineError(
                f"the {self.name} server at {self.base_url} did not answer {what} "
                f"within {deadline:g} s",
                fix="check that the server is not stuck (its log), "
                "or raise the engine's request timeout",
            ) from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            self._raise_if_crashed(what)
            raise EngineError(
                f"cannot reach the {self.name} server at {self.base_url} ({what}): "
                f"{type(exc).__name__}: {exc}",
                fix="start the server, or check the engine's url/host/port options",
            ) from exc
        if response.status_code in accept:
            return response
        if response.status_code in (404, 405) and error_message(response) in ROUTE_NOT_FOUND:
            raise EngineError(
                f"the {self.name} server at {self.base_url} has no endpoint {what} "
                f"(HTTP {response.status_code}); this engine version lacks it, or it is disabled",
                fix="use an engine version with this endpoint, "
                "or enable it (see the plugin's README)",
            )
        raise EngineError(
            f"the {self.name} server answered {what} with HTTP {response.status_code}: "
            f"{error_message(response)}",
        )

    async def json(self, method: str, path: str, **kwargs: Any) -> Any:
        """The decoded JSON body of a successful request (None for an empty body)."""
        response = await self.request(method, path, **kwargs)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise EngineError(
                f"the {self.name} server answered {method} {path} with a body that is not JSON: "
                f"{response.text[:200]!r}"
            ) from None

    def _raise_if_crashed(self, what: str) -> None:
        if self.server is not None and not self.server.alive():
            raise self.server.crash_error(f" (during {what})")

    async def aclose(self) -> None:
        if self._client is not None and not self._client.closed:
            with contextlib.suppress(RuntimeError):  # its event loop may be gone
                await self._client.close()
        self._client = None


ROUTE_NOT_FOUND = frozenset({"Not Found", "Method Not Allowed", ""})
"""What web frameworks answer for a path or method they have no route for."""


def error_message(response: Any) -> str:
    """The error text of a reply: `{"error": {"message"}}`, `{"error": str}`, `{"detail"}`, or
    text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error", body.get("detail", body.get("message")))
        if isinstance(error, dict):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:500]
    return str(body)[:500]


class PauseGate:
    """Holds new requests while paused. Thread-agnostic: one gate per engine, any event loop."""

    def __init__(self) -> None:
        self._paused = False
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop has nobody waiting
                loop.call_soon_threadsafe(_set_done, future)

    async def wait_open(self, timeout_s: float | None = None) -> None:
        """Return once not paused; an `EngineError` after `timeout_s` (None = no limit)."""
        while True:
            with self._lock:
                if not self._paused:
                    return
                loop = asyncio.get_running_loop()
                future: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, future))
            try:
                await asyncio.wait_for(future, timeout_s)
            except TimeoutError:
                raise EngineError(
                    f"the engine stayed paused for more than {timeout_s:g} s; "
                    "the request was not sent",
                    fix="call resume() after the weight update, "
                    "or raise the engine's pause_timeout_s",
                ) from None


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# ---------------------------------------------------------------------------------------------
# Wire pieces shared by the server-backed engines
# ---------------------------------------------------------------------------------------------

BASE_VERSION_NAMES = frozenset({"default", ""})
"""Weight-version strings a server reports before anyone set one: they mean version 0."""


def model_vocab_size(model: ResolvedModel) -> int:
    """The model's embedding rows (config.json `vocab_size`)."""
    try:
        config = json.loads((Path(model.path) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(
            f"cannot read {model.path}/config.json: {exc}",
            fix="point model.name at a Hugging Face checkpoint directory",
        ) from exc
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not size:
        raise EngineError(f"{model.path}/config.json has no vocab_size")
    return int(size)


def sampling_room(
    prompt: ModelInput, num_samples: int, vocab_size: int, context: int, option: str
) -> tuple[list[int], int]:
    """(the prompt's checked token ids, how many tokens fit after it under the server's `context`
    length, set by inference.options.`option`) for a request of `num_samples` completions."""
    ids = prompt_token_ids(prompt, vocab_size)
    if num_samples < 1:
        raise DataError(f"num_samples must be >= 1, got {num_samples}")
    room = context - len(ids)
    if room < 1:
        raise DataError(
            f"prompt of {len(ids)} tokens leaves no room under {option} {context}",
            fix=f"shorten the prompt or raise inference.options.{option}",
        )
    return ids, room


def parse_weight_version(label: Any) -> int:
    """A server's weight-version label as plait's integer version ("default" = 0)."""
    text = "" if label is None else str(label)
    if text in BASE_VERSION_NAMES:
        return 0
    try:
        return int(text)
    except ValueError:
        raise EngineError(
            f"the server reports weight version {text!r}, which plait did not set",
            fix="let plait set weight versions (one engine per server), or restart the server",
        ) from None


def token_versions(
    spans: Sequence[Mapping[str, Any]] | None, num_tokens: int, fallback: int
) -> tuple[int, ...]:
    """Per-token versions from `[{"version", "start", "end"}, ...]` spans over output indices;
    tokens no span covers get `fallback`."""
    versions = [fallback] * num_tokens
    for span in spans or ():
        version = parse_weight_version(span.get("version"))
        for i in range(max(0, int(span["start"])), min(num_tokens, int(span["end"]))):
            versions[i] = version
    return tuple(versions)


class WeightStaging:
    """Writes weight updates as safetensors directories (`<root>/v<N>/`) for a server to load,
    keeping only the newest. `root` None = a temporary directory, removed by `cleanup`."""

    def __init__(self, root: str | Path | None, prefix: str) -> None:
        self._owned = root is None
        self.root = (
            Path(tempfile.mkdtemp(prefix=prefix)) if root is None else Path(root).expanduser()
        )
        self.root.mkdir(parents=True, exist_ok=True)

    async def stage(self, update: WeightUpdate) -> Path:
        if update.kind != "full":
            raise EngineError(
                f"this engine loads full weight updates from disk, got kind {update.kind!r}",
                fix="use a weight sync whose payload is 'full', "
                "or one that writes deltas into a checkpoint",
            )
        from plait_weights.sync import save_safetensors

        return await asyncio.to_thread(
            save_safetensors, update.tensors, self.root / f"v{update.version}"
        )

    def prune(self, keep: Path) -> None:
        for path in self.root.glob("v*"):
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    def cleanup(self) -> None:
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The engine lifecycle
# ---------------------------------------------------------------------------------------------


@attrs.frozen
class ServerOptions:
    """Options every server-backed engine has (`inference.options` in a run config)."""

    url: str | None = None
    """Attach to a running server (e.g. "http://127.0.0.1:8000"); None launches one."""
    python: str | None = None
    """The interpreter that launches the server (None: see the engine's README)."""
    host: str = "127.0.0.1"
    port: int | None = None
    """None = a free port."""
    server_args: list[str] = attrs.field(factory=list)
    """Extra command-line arguments for a launched server."""
    env: dict[str, str] = attrs.field(factory=dict)
    """Extra environment variables for a launched server."""
    api_key: str | None = None
    startup_timeout_s: float = attrs.field(default=900.0, validator=positive)
    """How long a launched server may take to answer /health (minutes on a loaded 2-core
    machine)."""
    request_timeout_s: float = attrs.field(default=600.0, validator=positive)
    """Deadline of one sampling request."""
    control_timeout_s: float = attrs.field(default=120.0, validator=positive)
    """Deadline of pause, resume, weight loading and other control calls."""
    keepalive_s: float = attrs.field(default=1.0, validator=positive)
    """How long an idle connection to the server is kept for the next request; keep it under the
    server's own idle limit (uvicorn's, vLLM's and SGLang's: 5 s), or a request sent as the
    server closes the connection is lost."""
    pause_timeout_s: float | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive)
    )
    """How long `sample` waits while the engine is paused (None = until resume)."""
    log_path: str | None = None
    """Where a launched server's output goes; None = a file in the temporary directory (logged)."""
    weights_dir: str | None = None
    """Where `apply_weights` stages safetensors for the server to load (it must be able to read
    them); None = a temporary directory."""
    max_restarts: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    """How many times a launched server that dies is started again (with its weights, its
    running requests sent once more) before the engine gives up; 0 = never. An attached server
    (url) is never restarted."""


class ServerEngine:
    """The lifecycle shared by inference engines that drive a server over HTTP.

    A subclass sets `server_name`, builds the launch command in `launch_command`, reads what it
    needs once the server answers in `_on_ready`, and implements sampling, pause and weight
    loading on its wire: `_load_weights_from_disk`, `_set_weight_version` and, with LoRA,
    `_load_lora_adapter` / `_unload_lora_adapter` (the public methods here add restarts and
    remember what a restarted server must get back). Its sampling requests go through
    `_reissued_after_restart(send, in_flight=True)`; a broadcast weight update sets
    `_weights_from_broadcast`, and joining or leaving a broadcast group `_in_broadcast_group`.
    """

    server_name = "server"

    def __init__(self, model: ResolvedModel, options: ServerOptions, seed: int) -> None:
        self.model = model
        self.options = options
        self.vocab_size = model_vocab_size(model)
        self._rng = random.Random(seed)
        self._launch_seed = seed
        self._version = 0
        self._gate = PauseGate()
        self._update_lock: asyncio.Lock | None = None
        self._inflight = 0
        self._idle: asyncio.Condition | None = None
        self._ready = False
        self._ready_lock: asyncio.Lock | None = None
        self._closed = False
        self._staging = WeightStaging(
            options.weights_dir, f"plait-{self.server_name.lower()}-weights-"
        )
        # What a restarted server must be given back (see `_restore`).
        self._weights_path: str | None = None  # None: the checkpoint a new server starts with
        self._weights_from_broadcast = False
        self._in_broadcast_group = False
        self._lora_adapters: dict[str, str] = {}
        self._restarts = 0
        self._restart_lock: asyncio.Lock | None = None
        self._restarter: asyncio.Task[Any] | None = None
        self._log_path = options.log_path
        self.server: LaunchedServer | None = None
        if options.url:
            self.http = self._client(options.url, None)
        else:
            self._launch()

    def _client(self, base_url: str, server: LaunchedServer | None) -> EngineHTTP:
        headers = (
            {"Authorization": f"Bearer {self.options.api_key}"} if self.options.api_key else None
        )
        return EngineHTTP(
            base_url,
            name=self.server_name,
            timeout_s=self.options.control_timeout_s,
            server=server,
            headers=headers,
            keepalive_s=self.options.keepalive_s,
        )

    def _launch(self) -> None:
        self.server, base_url = self.start_server()
        self.http = self._client(base_url, self.server)

    # -- for subclasses -------------------------------------------------------------------

    def start_server(self) -> tuple[LaunchedServer, str]:
        """Start the server's command on this machine (on options.port, or a free port): the
        server and its base URL. Every launch of this engine writes to the same log file. A
        subclass that places its server elsewhere overrides this."""
        port = self.options.port or free_port(self.options.host)
        if self._log_path is None:
            self._log_path = os.path.join(
                tempfile.gettempdir(), f"plait-{self.server_name.lower()}-{os.getpid()}-{port}.log"
            )
        argv, env = self.launch_command(port, self._launch_seed)
        return ServerProcess(
            self.server_name, argv, log_path=self._log_path, env=env
        ), f"http://{self.options.host}:{port}"

    def launch_command(self, port: int, seed: int) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError

    async def _on_ready(self) -> None:
        """Called when the server first answers /health (and again after each restart)."""

    async def _status(self) -> str:
        """One line for `health()`."""
        return self.http.base_url

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def base_url(self) -> str:
        return self.http.base_url

    @property
    def restarts(self) -> int:
        """How many times this engine has launched its server again after it died."""
        return self._restarts

    async def _healthy(self) -> bool:
        timeout = min(10.0, self.options.control_timeout_s)
        response = await self.http.request("GET", "/health", timeout_s=timeout, accept=(200, 503))
        return response.status_code == 200

    async def _answers_health(self) -> bool:
        try:
            return await self._healthy()
        except EngineError:
            return False

    async def _ensure_ready(self) -> None:
        if self._closed:
            raise EngineError(f"the {self.server_name} engine is closed", fix="build a new engine")
        if self._ready:
            # The restart's own calls (restoring the weights) go through; everyone else waits
            # for a restart under way, or starts one for a server found dead.
            if asyncio.current_task() is not self._restarter:
                if self._restart_lock is not None and self._restart_lock.locked():
                    async with self._restart_lock:
                        pass
                if self.server is not None and not self.server.alive():
                    await self._restart(self.server)
            return
        if self._ready_lock is None:
            self._ready_lock = asyncio.Lock()
        async with self._ready_lock:  # concurrent first requests share one start-up wait
            if self._ready:
                return
            if self.server is not None:
                await self.server.wait_healthy(
                    self._healthy, timeout_s=self.options.startup_timeout_s
                )
            elif not await self._healthy():
                raise EngineError(
                    f"the {self.server_name} server at {self.http.base_url} is not healthy "
                    "(GET /health answered 503)",
                    fix="wait for it to finish starting, or check its log",
                )
            await self._on_ready()
            self._ready = True

    async def health(self) -> EngineHealth:
        if self._closed:
            return EngineHealth(False, self._version, "closed")
        if self.server is not None and not self.server.alive():
            return EngineHealth(
                False, self._version, f"server exited with code {self.server.exit_code}"
            )
        try:
            if not await self._healthy():
                return EngineHealth(False, self._version, "starting")
            await self._ensure_ready()
            detail = await self._status()
        except EngineError as exc:
            return EngineHealth(False, self._version, str(exc))
        return EngineHealth(True, self._version, detail)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._gate.resume()  # waiting requests wake up and fail on the closed engine
        await self.http.aclose()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        self._staging.cleanup()

    # -- restarts -------------------------------------------------------------------------

    async def _reissued_after_restart(
        self, send: Callable[[], Awaitable[T]], *, in_flight: bool
    ) -> T:
        """`send()`: one request to the server. If it fails because the launched server died,
        the server is restarted (see `_restart`) and `send()` runs once more, on the new one.
        `in_flight`: a sampling request, which waits while the engine is paused and counts as
        in flight (`_request_slot`); otherwise a control call (weights, adapters)."""
        reissued = False
        while True:
            async with self._request_slot() if in_flight else self._ready_slot():
                server = self.server
                try:
                    return await send()
                except EngineError as exc:
                    failure = exc
            # outside the slot: a pause("wait") must not wait for a restart
            if reissued or not await self._replaced_dead_server(server, failure):
                raise failure
            reissued = True
            log.debug(
                "re-issuing a request that was running when the server died",
                server=self.server_name,
            )

    @contextlib.asynccontextmanager
    async def _ready_slot(self) -> Any:
        await self._ensure_ready()
        yield

    async def _replaced_dead_server(
        self, server: LaunchedServer | None, failure: EngineError
    ) -> bool:
        """After a request to `server` failed with `failure`: True once a new server stands in
        place of that one, which was dead (restarted here, or by a concurrent request); False
        when the server is fine and the failure was the request's own. An `EngineError` when
        the server is down and will not come back."""
        if self._closed:
            return False
        if server is None:
            if await self._answers_health():
                return False
            raise EngineError(
                failure.message,
                fix=f"this engine is attached to the server at {self.options.url} "
                "(inference.options.url), and plait restarts only servers it launched: "
                "restart that server, or leave url unset so that the engine launches "
                "(and restarts) its own",
            ) from failure
        if self.server is not server:
            return True
        # A server whose process lives on can still be dead inside (vLLM: EngineCore died, and
        # the API server answers 500 until it shuts itself down).
        if server.alive() and await self._answers_health():
            return False
        await self._restart(server)
        return True

    async def _restart(self, dead: LaunchedServer) -> None:
        """Replace the launched server `dead` with a new one: the same command (on a fresh port
        unless options.port), the weights the dead one had, and no request reaches it before it
        has them. Nothing to do when a concurrent request has replaced it already."""
        if self._restart_lock is None:
            self._restart_lock = asyncio.Lock()
        async with self._restart_lock:
            if self.server is not dead or self._closed:
                return
            for _ in range(
                20
            ):  # a process killed a moment ago is reaped in a moment: then say how it ended
                if not dead.alive():
                    break
                await asyncio.sleep(0.1)
            how = (
                dead.how_it_ended()
                if not dead.alive()
                else f"stopped answering GET /health{dead.location}"
            )
            if self._restarts >= self.options.max_restarts:
                raise EngineError(
                    f"the {self.server_name} server {how} after {self._restarts} restarts "
                    f"(inference.options.max_restarts = {self.options.max_restarts}); "
                    f"last lines of {dead.log_path}:\n{dead.log_tail()}",
                    fix="read the server log for the cause; raise inference.options.max_restarts "
                    "to restart it more often",
                )
            reason = self._why_weights_cannot_be_restored()
            if reason is not None:
                raise EngineError(
                    f"the {self.server_name} server {how}, and a new one could not be given "
                    f"its weights: {reason}; last lines of {dead.log_path}:\n{dead.log_tail()}",
                    fix="read the server log for the cause; weights synced by disk "
                    "(sync.method 'disk' or 'in_process') are given back to a restarted server",
                )
            self._restarts += 1
            log.warning(
                f"the {self.server_name} server {how}; "
                "restarting it and re-issuing its running requests",
                server=self.server_name,
                exit_code=dead.exit_code,
                log=str(dead.log_path),
                restart=f"{self._restarts} of {self.options.max_restarts}",
            )
            version = self._version
            await asyncio.to_thread(
                dead.stop
            )  # the rest of its process group too (vLLM's EngineCore)
            await self.http.aclose()
            self._restarter = asyncio.current_task()
            try:
                self._launch()
                assert self.server is not None
                await self.server.wait_healthy(
                    self._healthy, timeout_s=self.options.startup_timeout_s
                )
                await self._on_ready()
                await self._restore(version)
            except BaseException:
                if self.server is not None:
                    self.server.stop(grace_s=0)  # a server without its weights must take no request
                raise
            finally:
                self._restarter = None
            log.info(
                "server restarted", server=self.server_name, version=version, url=self.http.base_url
            )

    def _why_weights_cannot_be_restored(self) -> str | None:
        if self._in_broadcast_group:
            return "it had joined a weight broadcast group, which a new server is not part of"
        if self._weights_from_broadcast:
            return "its weights came by broadcast, and no copy of them is on disk"
        return None

    async def _restore(self, version: int) -> None:
        """Give a restarted server what the dead one had: the weights it last loaded from disk
        (or the checkpoint, which a new server starts with), the version label, the adapters."""
        try:
            if self._weights_path is not None:
                await self._load_weights_from_disk(self._weights_path, version)
            elif version != self._version:
                await self._set_weight_version(version)
            for name, path in self._lora_adapters.items():
                await self._load_lora_adapter(name, path)
        except EngineError as exc:
            raise EngineError(
                f"the restarted {self.server_name} server could not be given the weights "
                f"it had (version {version}, from {self._weights_path or self.model.path}): "
                f"{exc.message}",
                fix=exc.fix,
            ) from exc
        self._version = version

    # -- requests -------------------------------------------------------------------------

    def _seed(self, seed: int | None) -> int:
        return seed if seed is not None else self._rng.getrandbits(31)

    @contextlib.asynccontextmanager
    async def _request_slot(self) -> Any:
        """Wait while paused, then count the request as in flight until it returns."""
        await self._ensure_ready()
        await self._gate.wait_open(self.options.pause_timeout_s)
        await self._ensure_ready()
        self._inflight += 1
        try:
            yield
        finally:
            self._inflight -= 1
            if self._idle is not None:
                async with self._idle:
                    self._idle.notify_all()

    async def _wait_idle(self, timeout_s: float) -> None:
        """Return once none of this engine's requests is in flight."""
        if self._idle is None:
            self._idle = asyncio.Condition()
        try:
            async with self._idle:
                await asyncio.wait_for(self._idle.wait_for(lambda: self._inflight == 0), timeout_s)
        except TimeoutError:
            raise EngineError(
                f"{self._inflight} requests were still running after {timeout_s:g} s",
                fix="raise the engine's request_timeout_s, or pause with mode 'abort'",
            ) from None

    def _lock(self) -> asyncio.Lock:
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        return self._update_lock

    # -- weights --------------------------------------------------------------------------

    async def apply_weights(self, update: WeightUpdate) -> None:
        """Full tensors go by disk (staged as safetensors, then loaded in place by the server);
        an update without tensors only bumps the version (the weights came another way)."""
        if not update.tensors:
            await self.set_weight_version(update.version)
            return
        path = await self._staging.stage(update)
        await self.load_weights_from_disk(str(path), update.version)
        self._staging.prune(keep=path)  # the newest stays: a restarted server reloads it

    async def load_weights_from_disk(self, path: str, version: int) -> None:
        """Load the safetensors in directory `path` as `version` (sent again to a restarted
        server if this one dies under it; a restarted server reloads `path`)."""
        await self._reissued_after_restart(
            lambda: self._load_weights_from_disk(str(path), version), in_flight=False
        )
        self._weights_path = str(path)
        self._weights_from_broadcast = False

    async def set_weight_version(self, version: int) -> None:
        await self._reissued_after_restart(
            lambda: self._set_weight_version(version), in_flight=False
        )

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load (or replace) the PEFT adapter in directory `path` under `name` (the server needs
        enable_lora); a restarted server loads it again."""
        await self._reissued_after_restart(
            lambda: self._load_lora_adapter(name, str(path)), in_flight=False
        )
        self._lora_adapters[name] = str(path)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._reissued_after_restart(lambda: self._unload_lora_adapter(name), in_flight=False)
        self._lora_adapters.pop(name, None)

    async def _load_weights_from_disk(self, path: str, version: int) -> None:
        raise NotImplementedError

    async def _set_weight_version(self, version: int) -> None:
        raise NotImplementedError

    async def _load_lora_adapter(self, name: str, path: str) -> None:
        raise EngineError(f"the {self.server_name} engine has no LoRA adapters")

    async def _unload_lora_adapter(self, name: str) -> None:
        raise EngineError(f"the {self.server_name} engine has no LoRA adapters")
