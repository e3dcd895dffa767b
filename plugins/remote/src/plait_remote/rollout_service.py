"""`plait serve rollout`: a rollout worker, an environment and the agent loop in one service.

A worker runs whole episodes next to its environment: the environment's calls (tools, a slow
verifier, a sandbox) stay on the worker's machine, and only the model calls cross the network, to
the run's inference service. It serves the run config's `[env]` over ORS (so the run lists and
reads tasks from it as from any ORS server) and one route of its own:

- `POST /rollout/episode {"task", "config": EpisodeConfig, "inference": {"url", "api_key"}}` ->
  `{"trajectory": Trajectory, "clock": <the worker's perf_counter>}`: the episode
  (`plait.rollout.run_episode`) with the config's `[renderer]` on its `[model]`, sampling from the
  `plait serve inference` service at `url`. An environment that fails gives a trajectory with its
  `error` set, as in a run.
- `GET /rollout/info` -> `{"model", "renderer", "env"}`: what the worker was built with.

In a run, `env.name = "rollout"` attaches to one worker by URL, and `env.name = "pool"` with
`options.rollout_config` launches workers as its members (and scales them). The run's inference
engine must be "remote" (the service the workers sample from too): `RolloutWorkerEnv` refuses any
other with that fix.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import structlog

from plait.api import (
    ConfigError,
    EpisodeConfig,
    InferenceEngine,
    Renderer,
    Trajectory,
    from_json,
    run_episode,
    to_json,
)
from plait_remote.wire import endpoint, field
from plait_sdk.client import ORSEnvironment, ORSOptions
from plait_server.engine import Reply, error_message

log = structlog.get_logger("plait_remote")

NOT_WORKER_ENVS = ("rollout", "pool")


@attrs.frozen
class RolloutWorkerOptions(ORSOptions):
    """A running `plait serve rollout` worker at `url` (`api_key` if it was given one)."""


class RolloutService:
    """The worker's HTTP face (see the module docstring for the wire)."""

    def __init__(
        self,
        env: Any,
        renderer: Renderer,
        model: Any,
        *,
        names: Mapping[str, str],
        api_key: str | None = None,
    ) -> None:
        from starlette.applications import Starlette
        from starlette.routing import Route

        from plait_sdk.server import Server, ServerOptions

        self.env = env
        self.renderer = renderer
        self.model = model
        self.names = dict(names)
        self._engines: dict[tuple[str, str | None], InferenceEngine] = {}
        self.ors = Server([env], options=ServerOptions(api_key=api_key))
        what = f"rollout worker of {names['env']}"
        self._rollout = Starlette(
            routes=[
                Route(
                    "/rollout/episode",
                    endpoint(self.episode, name=what, api_key=api_key),
                    methods=["POST"],
                ),
                Route(
                    "/rollout/info",
                    endpoint(self.info, name=what, api_key=api_key),
                    methods=["GET"],
                ),
            ]
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """ASGI: the worker's own routes, and every other path (and the lifespan) to the ORS
        server."""
        if scope["type"] == "http" and scope["path"].startswith("/rollout/"):
            await self._rollout(scope, receive, send)
        else:
            await self.ors.asgi(scope, receive, send)

    def _engine(self, url: str, api_key: str | None) -> InferenceEngine:
        """A client of the inference service at `url`, one per service."""
        from plait_remote.engine import RemoteEngine
        from plait_remote.options import RemoteOptions

        key = (url, api_key)
        if key not in self._engines:
            self._engines[key] = RemoteEngine(
                self.model, options=RemoteOptions(url=url, api_key=api_key)
            )
        return self._engines[key]

    async def episode(self, body: dict[str, Any]) -> Any:
        task = field(body, "task", _mapping)
        config = field(body, "config", lambda v: from_json(EpisodeConfig, v))
        inference = field(body, "inference", _mapping)
        url = field(inference, "url", str)
        engine = self._engine(url, inference.get("api_key"))
        trajectory = await run_episode(self.env, task, engine, self.renderer, config)
        return {"trajectory": to_json(trajectory), "clock": time.perf_counter()}

    async def info(self, _body: dict[str, Any]) -> Any:
        return self.names

    async def close(self) -> None:
        for engine in self._engines.values():
            await engine.close()
        await self.ors.close_all()
        await self.env.close()


def _mapping(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a JSON object, got {type(value).__name__}")
    return dict(value)


def build_worker(
    config_path: Path | None, overrides: tuple[str, ...], *, api_key: str | None
) -> RolloutService:
    """The worker of a run config: its `[model]`, `[renderer]` and `[env]`."""
    from plait.api import build, load_config, resolve_model
    from plait_sdk.plugin import build_environment

    config = load_config(config_path, overrides)
    if config.env.name in NOT_WORKER_ENVS:
        raise ConfigError(
            "env.name",
            f"a rollout worker runs one environment itself, not {config.env.name!r}",
            fix="name the environment the worker runs, e.g. -s env.name=math.arith",
        )
    model = resolve_model(
        config.model.name, tokenizer=config.model.tokenizer, dtype=config.model.dtype
    )
    renderer = build(
        "renderer",
        config.renderer.name,
        model,
        options=config.renderer.options,
        options_path="renderer.options",
    )
    env = build_environment(config.env.name, dict(config.env.options))
    names = {"model": str(model.path), "renderer": config.renderer.name, "env": config.env.name}
    return RolloutService(env, renderer, model, names=names, api_key=api_key)


def serve_rollout(
    config_path: Path | None,
    overrides: tuple[str, ...],
    *,
    host: str,
    port: int,
    api_key: str | None,
) -> None:
    """Build the config's rollout worker, then serve it until SIGINT or SIGTERM."""
    from plait_remote.wire import serve_until_stopped

    async def start() -> Any:
        worker = build_worker(config_path, overrides, api_key=api_key)
        return worker, "rollout worker", worker.close

    serve_until_stopped(start, host=host, port=port, api_key=api_key)


class RolloutWorkerEnv(ORSEnvironment):
    """`plait.protocols.Environment` and `DrivesEpisodes` on a `plait serve rollout` worker: tasks
    over ORS, and every episode run by the worker."""

    def __init__(self, options: ORSOptions) -> None:
        super().__init__(options)
        self.name = "rollout"

    @classmethod
    def from_options(cls, *, options: ORSOptions) -> RolloutWorkerEnv:
        return cls(options)

    async def run_episode(
        self,
        task: Mapping[str, Any],
        engine: InferenceEngine,
        renderer: Renderer,
        config: EpisodeConfig,
    ) -> Trajectory:
        from plait_remote.engine import RemoteEngine

        if not isinstance(engine, RemoteEngine):
            raise ConfigError(
                "inference.engine",
                f"rollout workers sample from the run's inference service, and "
                f"this run's engine is {type(engine).__name__} in its own process",
                fix='set inference.engine = "remote" (a plait serve inference service)',
            )
        body = {
            "task": dict(task),
            "config": to_json(config),
            "inference": {"url": engine.base_url, "api_key": engine.options.api_key},
        }
        try:
            answer = await self._post_episode(body)
        except Exception as exc:  # a worker that died or refused costs this episode only
            log.warning(
                "rollout worker failed an episode",
                url=self.url,
                error=f"{type(exc).__name__}: {exc}",
            )
            return Trajectory(
                task=dict(task),
                turns=(),
                error=f"the rollout worker at {self.url} failed: {type(exc).__name__}: {exc}",
            )
        trajectory = from_json(Trajectory, answer["trajectory"])
        # The worker timed its environment calls on its own clock: shift them onto this one.
        offset = time.perf_counter() - float(answer["clock"])
        return attrs.evolve(
            trajectory,
            env_seconds=[(start + offset, end + offset) for start, end in trajectory.env_seconds],
        )

    async def _post_episode(self, body: dict[str, Any]) -> Any:
        """One attempt, no deadline: an episode may run for long, and one sent again after a
        dropped connection would run twice on the worker."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, connect=10.0)
        async with self.http.client().post(
            self.url + "/rollout/episode", json=body, headers=self.headers(), timeout=timeout
        ) as response:
            reply = Reply(response.status, await response.read())
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {error_message(reply)}")
        return reply.json()
