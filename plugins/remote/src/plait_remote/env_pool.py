"""The "pool" environment: episodes spread over several ORS servers of one environment, elastic.

How many episodes run at once is often bounded by the environment side (a verifier that takes
seconds, a sandbox per episode), not by sampling. `env.name = "pool"` launches `members`
`plait env serve ENV` processes (on this machine, or on Ray nodes with `ray`) and runs each
episode on the member with the most room, at most `max_in_flight` episodes on each; the others
wait. With `scale_file` (`plait scale RUN_DIR env=N`), or `autoscale` (sized by the episodes
that wait for room, plait_remote.scale.Autoscaler), members join while the run goes (a new one
takes episodes once it answers) or leave: a member scaled away takes no new episode, finishes its
running ones, then stops, so no episode is lost. Every member serves the same environment with
the same options, so tasks come from any of them. A member that dies costs the episodes running
on it (each comes back as a failed trajectory, like any environment failure) and leaves the pool.

With `rollout_config` the members are rollout workers (`plait serve rollout`, see
plait_remote.rollout_service): each runs whole episodes, the agent loop beside the environment,
and only model calls cross to the run's inference service.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
    run_episode,
)
from plait_remote.options import EnvPoolOptions
from plait_remote.scale import autoscaler_for, drain, start_sizing
from plait_remote.wire import answers_health, start_service

log = structlog.get_logger("plait_remote")


def toml_value(value: Any) -> str:
    """`value` as a TOML value for `plait env serve -o key=VALUE`."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return json.dumps(value)  # strings, numbers and booleans read the same in TOML


class _Member:
    def __init__(self, name: str, server: Any, env: Any) -> None:
        self.name = name
        self.server = server
        self.env = env
        self.in_flight = 0
        self.episodes = 0
        self.draining = False


class EnvPool:
    """`plait.protocols.Environment` (and `DrivesEpisodes`) over a pool of ORS servers."""

    name = "pool"

    def __init__(self, options: EnvPoolOptions) -> None:
        if options.rollout_config is not None:
            config = Path(options.rollout_config).expanduser().resolve()
            if not config.is_file():
                raise ConfigError(
                    "env.options.rollout_config",
                    f"{options.rollout_config} is not a file",
                    fix="give the run config the rollout workers are built from (this run's own)",
                )
            options = attrs.evolve(options, rollout_config=str(config))
        self.options = options
        self._autoscaler = autoscaler_for(options, "env", "environment pool")
        self._api_key = (
            secrets.token_urlsafe(24) if options.ray is not None else None
        )  # beyond loopback
        self._built = 0
        self.members = [self._launch() for _ in range(options.members)]
        self._ready: asyncio.Task[None] | None = None
        self._room: asyncio.Condition | None = None
        self._membership: asyncio.Lock | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._retiring: set[asyncio.Task[None]] = set()
        self._closed = False

    @classmethod
    def from_options(cls, *, options: EnvPoolOptions) -> EnvPool:
        return cls(options)

    # -- members ---------------------------------------------------------------------------

    def _command(self, host: str, port: int) -> tuple[list[str], dict[str, str]]:
        o = self.options
        python = [o.python or sys.executable, "-m", "plait.cli"]
        where = ["--host", host, "--port", str(port)]
        if o.rollout_config is None:
            argv = [*python, "env", "serve", o.env, *where]
            for key, value in o.env_options.items():
                argv += ["-o", f"{key}={toml_value(value)}"]
            return argv, {"PLAIT_ORS_API_KEY": self._api_key} if self._api_key else {}
        argv = [
            *python,
            "serve",
            "rollout",
            o.rollout_config,
            "-s",
            f"env.name={o.env}",
            "-s",
            f"env.options={toml_value(o.env_options)}",
            *where,
        ]
        return argv, {"PLAIT_API_KEY": self._api_key} if self._api_key else {}

    def _launch(self) -> _Member:
        from plait_remote.rollout_service import RolloutWorkerEnv
        from plait_sdk.client import ORSEnvironment, ORSOptions

        self._built += 1
        kind = "environment" if self.options.rollout_config is None else "rollout worker"
        name = f"{self.options.env} {kind} #{self._built}"
        server, url = start_service(
            f"{self.options.env} {kind}",
            self._command,
            ray=self.options.ray,
            host="127.0.0.1",
            port=None,
            log_path=None,
            files={},
            timeout_s=self.options.startup_timeout_s,
        )
        env_class = ORSEnvironment if self.options.rollout_config is None else RolloutWorkerEnv
        return _Member(name, server, env_class(ORSOptions(url=url, api_key=self._api_key)))

    async def _healthy(self, member: _Member) -> None:
        await member.server.wait_healthy(
            lambda: answers_health(member.env.url), timeout_s=self.options.startup_timeout_s
        )

    async def _ensure_ready(self) -> None:
        if self._closed:
            raise EnvironmentError_("the environment pool is closed")
        if self._ready is None:  # concurrent first calls share one start-up wait
            self._ready = asyncio.ensure_future(self._start())
        await asyncio.shield(self._ready)

    async def _start(self) -> None:
        self._room, self._membership = asyncio.Condition(), asyncio.Lock()
        await asyncio.gather(*(self._healthy(member) for member in self.members))
        self._watcher = start_sizing(
            self.options, self._autoscaler, lambda: self.members, self.scale, "environment pool"
        )

    async def _notify(self) -> None:
        assert self._room is not None
        async with self._room:
            self._room.notify_all()

    async def scale(self, members: int) -> None:
        """Grow to `members` (each new one takes episodes once it answers), or drain the newest
        down to it (they finish their running episodes, then stop)."""
        if members < 1:
            raise ValueError(f"an environment pool keeps at least one member, asked for {members}")
        await self._ensure_ready()
        assert self._membership is not None
        async with self._membership:
            serving = [m for m in self.members if not m.draining]
            for _ in range(members - len(serving)):
                member = self._launch()
                try:
                    await self._healthy(member)
                except BaseException:
                    await self._stop(member)
                    raise
                self.members.append(member)
                log.info(
                    "member joined the environment pool",
                    member=member.name,
                    members=len(self.members),
                )
            drain(serving[members:], self._retire, self._retiring)
        await self._notify()

    async def _retire(self, member: _Member) -> None:
        assert self._room is not None
        async with self._room:
            await self._room.wait_for(lambda: member.in_flight == 0)
        await self._leave(member, "scaled down")

    async def _leave(self, member: _Member, why: str) -> None:
        if member not in self.members:  # another of its episodes saw it die first
            return
        self.members.remove(member)
        log.info(
            "member left the environment pool",
            member=member.name,
            why=why,
            episodes=member.episodes,
            members=len(self.members),
        )
        await self._stop(member)

    @staticmethod
    async def _stop(member: _Member) -> None:
        with contextlib.suppress(Exception):
            await member.env.close()
        await asyncio.to_thread(member.server.stop)

    # -- episodes --------------------------------------------------------------------------

    async def _acquire(self) -> _Member:
        await self._ensure_ready()
        assert self._room is not None
        cap = self.options.max_in_flight

        def room() -> list[_Member]:
            return [
                m for m in self.members if not m.draining and (cap is None or m.in_flight < cap)
            ]

        async with self._room:
            queued = (
                self._autoscaler.waiting()
                if self._autoscaler and not room()
                else contextlib.nullcontext()
            )
            with queued:
                await self._room.wait_for(lambda: bool(room()) or self._closed or not self.members)
            if self._closed or not self.members:
                raise EnvironmentError_(
                    "the environment pool is closed, or every member of it died"
                )
            member = min(room(), key=lambda m: m.in_flight)
            member.in_flight += 1
            return member

    async def run_episode(
        self,
        task: Mapping[str, Any],
        engine: InferenceEngine,
        renderer: Renderer,
        config: EpisodeConfig,
    ) -> Trajectory:
        member = await self._acquire()
        trajectory: Trajectory | None = None
        try:
            trajectory = await run_episode(member.env, task, engine, renderer, config)
            return trajectory
        finally:
            # A failed episode may be the member's death: find out before its room is given back,
            # or a waiting episode would be sent to it. The process can still look alive when its
            # sockets are already closed, so a member that does not answer /health counts as dead.
            if (trajectory is None or trajectory.error) and not await self._answers(member):
                log.warning(
                    "a member of the environment pool died; its running episodes fail",
                    member=member.name,
                    error=member.server.crash_error().message,
                )
                await self._leave(member, "died")
            member.in_flight -= 1
            member.episodes += 1
            await self._notify()

    @staticmethod
    async def _answers(member: _Member) -> bool:
        return member.server.alive() and await answers_health(member.env.url)

    # -- the Environment protocol ----------------------------------------------------------

    async def _serving(self) -> list[_Member]:
        await self._ensure_ready()
        serving = [m for m in self.members if not m.draining]
        if not serving:
            raise EnvironmentError_(
                "every member of the environment pool died", fix="read the members' logs"
            )
        return serving

    async def _any(self) -> Any:
        return (await self._serving())[0].env

    async def splits(self) -> list[Split]:
        return list(await (await self._any()).splits())

    async def num_tasks(self, split: str) -> int:
        return int(await (await self._any()).num_tasks(split))

    async def get_task(self, split: str, index: int) -> dict[str, Any]:
        return dict(await (await self._any()).get_task(split, index))

    async def open(
        self, task: Mapping[str, Any], secrets: Mapping[str, str] | None = None
    ) -> EnvSession:
        """A session on the least busy member, outside the episode caps (the run's episodes go
        through `run_episode`)."""
        return await min(await self._serving(), key=lambda m: m.in_flight).env.open(task, secrets)

    async def close(self) -> None:
        self._closed = True
        for task in [self._watcher, *self._retiring]:
            if task is not None:
                task.cancel()
        if self._room is not None:
            await self._notify()
        for member in list(self.members):
            await self._stop(member)
        self.members.clear()
