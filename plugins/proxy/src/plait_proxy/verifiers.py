"""`verifiers`: an environment whose tasks, rollouts and rewards are a verifiers environment's own.

The environment (`environment`: an importable module or installed package exposing
`load_environment(**args)`, verifiers 0.1.x) runs unmodified in its own venv (built by
scripts/ci/verifiers.sh; `python` names its interpreter) under a driver program
(`verifiers_driver.py`) that plait starts once and keeps: it loads the environment as `vf-eval`
does, lists its splits (train: `dataset`; test: `eval_dataset`, else `dataset`), and runs each
episode's rollout and rubric (`Environment.run_rollout`) with an OpenAI client pointed at a
session of plait-proxy. The trajectory is what the proxy recorded of that session, the token ids
the engine sampled, so the episode trains like any other; its reward is the rubric's (the weighted
sum of its functions), and each function's score is in `metrics` as `env/reward/<name>`.

Failures: an environment that raises, returns a reward that is not a number or outruns
`timeout_s` costs the episode (an environment error naming it); one that cannot be loaded (no
venv, package not installed, `load_environment` raising) stops the run with the fix. The engine
failing on a call of the episode is plait's own failure and raises EngineError. A rollout cut off
by the run's `max_turns` (the proxy refuses further calls) is scored on what it has and marked
truncated.

`api = "v1"` runs a verifiers 0.4.0 (`verifiers.v1`) taskset instead (`environment` its id, `args`
its config), in the venv scripts/ci/verifiers_v1.sh builds, under `verifiers_v1_driver.py`: the
same protocol, its episodes the taskset's own rollouts (the `null` harness in a subprocess,
its streaming model calls forwarded by verifiers' interception proxy to the session) and scores.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import structlog

from plait.api import (
    ConfigError,
    EnvironmentError_,
    EnvSession,
    EpisodeConfig,
    InferenceEngine,
    Renderer,
    Split,
    Trajectory,
)
from plait_proxy.harness import EpisodeProxy

log = structlog.get_logger("plait.proxy.verifiers")

Api = Literal["0.1", "v1"]
DRIVERS: dict[str, Path] = {
    "0.1": Path(__file__).with_name("verifiers_driver.py"),
    "v1": Path(__file__).with_name("verifiers_v1_driver.py"),
}
SETUPS = {"0.1": "scripts/ci/verifiers.sh", "v1": "scripts/ci/verifiers_v1.sh"}
VENVS = {
    "0.1": ("PLAIT_VERIFIERS_VENV", "verifiers"),
    "v1": ("PLAIT_VERIFIERS_V1_VENV", "verifiers-v1"),
}
WHAT = {"0.1": "verifiers 0.1.x", "v1": "verifiers 0.4.0"}
SPLIT_TYPES: dict[str, Literal["train", "validation", "test"]] = {"train": "train", "test": "test"}
READY = 0
"""The request id of the driver's first line (its splits, or why it could not start)."""


def default_python(api: Api = "0.1") -> str:
    """The interpreter of `api`'s venv: $PLAIT_VERIFIERS_VENV's, else .venvs/verifiers's in this
    checkout (0.1); $PLAIT_VERIFIERS_V1_VENV's, else .venvs/verifiers-v1's (v1)."""
    repo = Path(__file__).resolve().parents[4]
    variable, folder = VENVS[api]
    venv = os.environ.get(variable) or str(repo / ".venvs" / folder)
    return str(Path(venv) / "bin" / "python")


@attrs.frozen(kw_only=True)
class VerifiersOptions:
    environment: str
    """The verifiers environment: a module or installed package with `load_environment` (0.1),
    or a `verifiers.v1` taskset id, as `vf-eval` takes it (v1)."""
    args: dict[str, Any] = attrs.field(factory=dict)
    """Keyword arguments of `load_environment` (0.1), or the taskset's config (v1; JSON values)."""
    api: Api = "0.1"
    """Which verifiers: "0.1" (0.1.x, `verifiers_driver.py`) or "v1" (0.4.0's `verifiers.v1`,
    `verifiers_v1_driver.py`)."""
    python: str = attrs.field(
        default=attrs.Factory(lambda self: default_python(self.api), takes_self=True)
    )
    """The interpreter of the venv that has verifiers and the environment installed."""
    timeout_s: float = 600.0
    """Per episode: its rollout and scoring."""
    model_name: str = "plait"
    """The model name the environment's client is given (any name is accepted)."""
    max_context_tokens: int = 32768

    def __attrs_post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.api not in DRIVERS:
            raise ValueError(f"api must be one of {sorted(DRIVERS)}, got {self.api!r}")


class _Driver:
    """The driver process of one environment, answering JSON-line requests concurrently."""

    def __init__(self, process: asyncio.subprocess.Process, environment: str) -> None:
        self.process = process
        self.environment = environment
        self.loop = asyncio.get_running_loop()
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {
            READY: self.loop.create_future()
        }
        self._ids = 0
        self._stderr: collections.deque[str] = collections.deque(maxlen=10)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._drain())]

    @classmethod
    async def start(cls, options: VerifiersOptions) -> tuple[_Driver, dict[str, int]]:
        """The running driver and the environment's split sizes."""
        setup = SETUPS[options.api]
        if not Path(options.python).is_file():
            raise ConfigError(
                "env.options.python",
                f"no verifiers venv interpreter at {options.python}",
                fix=f"run {setup} (or set {VENVS[options.api][0]}, or env.options.python)",
            )
        process = await asyncio.create_subprocess_exec(
            options.python,
            "-P",  # not the driver's folder on sys.path: this module would shadow verifiers
            str(DRIVERS[options.api]),
            options.environment,
            json.dumps(options.args),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=2**26,  # a task's row is one line
            # uv (v1's null harness runs its chat program with it) trusts the system's
            # certificates, as pip does, rather than its own bundle
            env={"UV_NATIVE_TLS": "1", **os.environ},
        )
        driver = cls(process, options.environment)
        ready = await driver._pending[READY]
        del driver._pending[READY]
        if "fatal" in ready:
            await driver.close()
            raise ConfigError(
                "env.options.environment",
                f"the verifiers environment {options.environment!r} could not be loaded with "
                f"{options.python}: {ready['fatal']}",
                fix=f"install it and {WHAT[options.api]} into that venv ({setup} installs the "
                "examples), or fix its arguments (env.options.args)",
            )
        return driver, dict(ready["splits"])

    def alive(self) -> bool:
        return self.process.returncode is None and asyncio.get_running_loop() is self.loop

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        self._ids += 1
        request_id = self._ids
        future = self._pending[request_id] = self.loop.create_future()
        assert self.process.stdin is not None
        self.process.stdin.write(
            json.dumps({"id": request_id, "op": op, **fields}).encode() + b"\n"
        )
        try:
            await self.process.stdin.drain()
            return await future
        finally:
            self._pending.pop(request_id, None)

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            answer = json.loads(line)
            future = self._pending.get(answer.pop("id", READY))
            if future is not None and not future.done():
                future.set_result(answer)
        status = await self.process.wait()
        await asyncio.sleep(0.1)  # the last lines of stderr
        failure = EnvironmentError_(
            f"the verifiers driver of {self.environment!r} exited with {status}: "
            + " | ".join(self._stderr)
        )
        for request_id, future in self._pending.items():
            if not future.done():
                if request_id == READY:
                    future.set_result({"fatal": str(failure)})
                else:
                    future.set_exception(failure)

    async def _drain(self) -> None:
        """Keeps the tail of stderr for error messages (and the pipe from filling up)."""
        assert self.process.stderr is not None
        while line := await self.process.stderr.readline():
            text = line.decode(errors="replace").strip()
            if text:
                self._stderr.append(text)

    async def close(self) -> None:
        if self.process.returncode is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def kill(self) -> None:
        """Ends the process of a driver whose event loop is gone."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGKILL)


class VerifiersEnvironment:
    """A verifiers environment's tasks, rollouts and rubric, its model calls through the proxy."""

    def __init__(self, options: VerifiersOptions) -> None:
        self.options = options
        self.name = f"verifiers({options.environment})"
        self.proxy = EpisodeProxy(options.model_name, options.max_context_tokens)
        self._driver: _Driver | None = None
        self._sizes: dict[str, int] | None = None
        self._tasks: dict[tuple[str, int], dict[str, Any]] = {}
        self._starting = asyncio.Lock()

    async def _running(self) -> _Driver:
        """The driver, started on first use in this event loop (a loop of its own per loop)."""
        async with self._starting:
            if self._driver is None or not self._driver.alive():
                if self._driver is not None and self._driver.loop is not asyncio.get_running_loop():
                    self._driver.kill()
                self._driver, self._sizes = await _Driver.start(self.options)
        return self._driver

    async def _split_sizes(self) -> dict[str, int]:
        if self._sizes is None:
            await self._running()
        assert self._sizes is not None
        return self._sizes

    async def splits(self) -> list[Split]:
        return [Split(name, SPLIT_TYPES[name]) for name in await self._split_sizes()]

    async def num_tasks(self, split: str) -> int:
        sizes = await self._split_sizes()
        if split not in sizes:
            raise KeyError(f"{self.name} has no split {split!r} (it has {sorted(sizes)})")
        return sizes[split]

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        size = await self.num_tasks(split)
        if not 0 <= index < size:
            raise IndexError(f"{self.name} split {split!r} has {size} tasks, not index {index}")
        if (split, index) not in self._tasks:
            answer = await (await self._running()).request("task", split=split, index=index)
            if "error" in answer:
                raise EnvironmentError_(f"{self.name}: reading task {index}: {answer['error']}")
            self._tasks[split, index] = {"split": split, "index": index, **answer["task"]}
        return dict(self._tasks[split, index])

    async def open(
        self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None
    ) -> EnvSession:
        raise NotImplementedError(
            f"{self.name} runs whole episodes (run_episode); it opens no tool sessions"
        )

    async def close(self) -> None:
        if self._driver is not None:
            if self._driver.loop is asyncio.get_running_loop():
                await self._driver.close()
            else:
                self._driver.kill()
            self._driver = None
        await self.proxy.close()

    async def run_episode(
        self,
        task: Mapping[str, Any],
        engine: InferenceEngine,
        renderer: Renderer,
        config: EpisodeConfig,
    ) -> Trajectory:
        url = await self.proxy.url(engine, renderer)
        driver = await self._running()
        answer: dict[str, Any] = {}
        async with self.proxy.session(config) as session:
            try:
                answer = await asyncio.wait_for(
                    driver.request(
                        "run",
                        split=task["split"],
                        index=task["index"],
                        base_url=f"{url}/s/{session.id}/v1",
                        api_key=session.id,
                        model=self.options.model_name,
                    ),
                    self.options.timeout_s,
                )
            except TimeoutError:
                answer = {"error": f"the rollout ran past timeout_s={self.options.timeout_s}"}
            except EnvironmentError_ as exc:
                answer = {"error": str(exc)}
            turns = session.turns()
            capped = session.policy_exhausted
        error = answer.get("error")
        if error is None and answer["rollout_error"] is not None and not capped:
            error = f"its rollout failed: {answer['rollout_error']}"
        if error is not None:
            log.warning(
                "verifiers episode failed", environment=self.options.environment, error=error
            )
            return Trajectory(
                task=dict(task), turns=turns, error=f"{self.name}: {error}", truncated=capped
            )
        reward = answer["reward"]
        truncated = capped or answer["truncated"]
        return Trajectory(
            task=dict(task),
            turns=turns,
            rewards=[reward],
            reward=reward,
            correct=reward >= answer["pass_threshold"],  # verifiers' own pass@k rule
            finished=not truncated,
            truncated=truncated,
            metrics={f"env/reward/{name}": value for name, value in answer["metrics"].items()},
        )


def make_verifiers_env(*, options: VerifiersOptions) -> VerifiersEnvironment:
    return VerifiersEnvironment(options)
