"""Pools that change size while a run goes: `plait scale RUN_DIR inference=N env=M`, the scale
file the pools follow, and the autoscaling policy.

The run's config (RUN_DIR/config.toml, written when it started) names each pool's `scale_file`;
the command writes `{"replicas": N}` there (atomically) and the pool, which reads it every
`poll_s` seconds, grows (an inference replica gets the newest weights before it serves) or
drains its newest members (they finish what they run, take nothing new, and leave).

A pool with `autoscale` sizes itself from its queue instead: work that waits for room (every
member at `max_in_flight`) for `stall_s` adds a member; when nothing has waited for `idle_s` and
the most work in flight over the last `idle_s` would fit on one member fewer, the newest drains.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import time
import tomllib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog

from plait.api import ConfigError, PlaitError, positive

log = structlog.get_logger("plait_remote")

SCALABLE = {"inference": "engine", "env": "name"}
"""The config sections whose component can be a "pool", and the key that names the component."""


def scale_file_of(run_dir: Path, section: str) -> tuple[Path, float]:
    """(the scale file the run's `section` pool reads, how often it reads it)."""
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise ConfigError(
            "RUN_DIR",
            f"{run_dir} holds no config.toml, so it is not a run's directory",
            fix="give the directory `plait run` printed at its start (out_dir/name)",
        )
    table, key = tomllib.loads(config_path.read_text()).get(section, {}), SCALABLE[section]
    if table.get(key) != "pool":
        raise ConfigError(
            f"{section}.{key}",
            f"the run in {run_dir} has {section}.{key} = {table.get(key)!r}, "
            f"and only a pool scales",
            fix=f'start the run with {section}.{key} = "pool" and {section}.options.scale_file set',
        )
    options = table.get("options") or {}
    if not options.get("scale_file"):
        suggested_file = run_dir / f"{section}-scale.json"
        raise ConfigError(
            f"{section}.options.scale_file",
            f"the {section} pool of the run in {run_dir} reads no scale file",
            fix=f'start the run with {section}.options.scale_file = "{suggested_file}"',
        )
    return Path(options["scale_file"]).expanduser(), float(options.get("poll_s", 1.0))


def scale(run_dir: Path, section: str, replicas: int) -> Path:
    """Ask the run's `section` pool for `replicas` members; the scale file written."""
    if replicas < 1:
        raise ConfigError(
            section,
            f"a pool needs at least one member, asked for {replicas}",
            fix="ask for 1 or more",
        )
    path, _ = scale_file_of(run_dir, section)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps({"replicas": replicas}))
    os.replace(partial, path)  # the pool never reads half a file
    return path


async def follow_scale_file(
    path: Path, poll_s: float, resize: Callable[[int], Awaitable[None]], what: str
) -> None:
    """Every `poll_s` seconds, `resize(n)` when `{"replicas": n}` in `path` changes (until
    cancelled). A missing or unreadable file is waited for; a resize that fails is logged, and
    tried again when the file asks for something else."""
    wanted: int | None = None
    while True:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            asked = int(json.loads(path.read_text())["replicas"])
            if asked != wanted:
                wanted = asked
                log.info(f"scaling the {what}", replicas=asked, file=str(path))
                try:
                    await resize(asked)
                except (PlaitError, ValueError) as exc:
                    log.error(f"could not scale the {what}", replicas=asked, error=str(exc))
        await asyncio.sleep(poll_s)


def drain(
    members: Sequence[Any], retire: Callable[[Any], Awaitable[None]], tasks: set[asyncio.Task[None]]
) -> None:
    """Mark `members` draining (they take no new work) and retire each, newest first, in a task
    kept in `tasks` until it is done (a pool cancels what is left when it closes)."""
    for member in reversed(members):
        member.draining = True
        task = asyncio.ensure_future(retire(member))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


@attrs.frozen
class AutoscaleOptions:
    """A pool sized by its queue, between `min` and `max` members (see the module docstring)."""

    min: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    max: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    stall_s: float = attrs.field(default=5.0, validator=positive)
    """How long work may wait for room before a member is added (also the pause after any change,
    so that a new member can start before the next decision)."""
    idle_s: float = attrs.field(default=30.0, validator=positive)
    """How long nothing must have waited before a member is drained."""

    def __attrs_post_init__(self) -> None:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")


def autoscaler_for(options: Any, section: str, what: str) -> Autoscaler | None:
    """The autoscaler of a pool's options (None without `autoscale`), which must cap its members
    and not also follow a scale file."""
    if options.autoscale is None:
        return None
    if options.max_in_flight is None:
        raise ConfigError(
            f"{section}.options.max_in_flight",
            "autoscale sizes the pool by the work that waits "
            "for room, and without a cap nothing waits",
            fix=f"set {section}.options.max_in_flight (what one member runs at once)",
        )
    if options.scale_file is not None:
        raise ConfigError(
            f"{section}.options.scale_file",
            "a pool follows either its scale file or autoscale",
            fix=f"leave out {section}.options.scale_file or {section}.options.autoscale",
        )
    return Autoscaler(options.autoscale, what)


class Autoscaler:
    """The queue of one pool, and the size it should have. The pool counts its waiting work with
    `waiting()` and reports its load to `wanted`; `follow` resizes it every `poll_s` seconds."""

    def __init__(self, options: AutoscaleOptions, what: str) -> None:
        self.options = options
        self.what = what
        self.waiting_now = 0
        now = time.monotonic()
        self._queued_since: float | None = None
        self._calm_since = now  # the last time work waited, or the pool changed size
        self._changed = now
        self._load: collections.deque[tuple[float, int]] = (
            collections.deque()
        )  # (time, in flight) over idle_s

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Around the wait of one piece of work for room."""
        self.waiting_now += 1
        if self._queued_since is None:
            self._queued_since = time.monotonic()
        try:
            yield
        finally:
            self.waiting_now -= 1
            self._calm_since = time.monotonic()
            if not self.waiting_now:
                self._queued_since = None

    def wanted(self, serving: int, in_flight: int, cap: int) -> int:
        """The size the pool should have now, given its serving members and their work in flight."""
        now, o = time.monotonic(), self.options
        self._load.append((now, in_flight))
        while self._load[0][0] < now - o.idle_s:
            self._load.popleft()
        if serving < o.min:
            return o.min
        if now - self._changed < o.stall_s:
            return serving
        if (
            self._queued_since is not None
            and now - self._queued_since >= o.stall_s
            and serving < o.max
        ):
            return serving + 1
        if (
            serving > o.min
            and not self.waiting_now
            and now - self._calm_since >= o.idle_s
            and max(load for _, load in self._load) <= (serving - 1) * cap
        ):
            return serving - 1
        return min(serving, o.max)

    async def follow(
        self,
        poll_s: float,
        load: Callable[[], tuple[int, int]],
        cap: int,
        resize: Callable[[int], Awaitable[None]],
    ) -> None:
        """Every `poll_s` seconds, `resize` the pool to what `wanted` says for `load()` (serving
        members, work in flight), until cancelled; a resize that fails is logged and tried again."""
        while True:
            serving, in_flight = load()
            size = self.wanted(serving, in_flight, cap)
            if size != serving:
                log.info(
                    f"autoscaling the {self.what}",
                    members=size,
                    waiting=self.waiting_now,
                    in_flight=in_flight,
                )
                self._changed = self._calm_since = time.monotonic()
                try:
                    await resize(size)
                except (PlaitError, ValueError) as exc:
                    log.error(f"could not autoscale the {self.what}", members=size, error=str(exc))
            await asyncio.sleep(poll_s)


def start_sizing(
    options: Any,
    autoscaler: Autoscaler | None,
    members: Callable[[], Sequence[Any]],
    resize: Callable[[int], Awaitable[None]],
    what: str,
) -> asyncio.Task[None] | None:
    """The task that sizes a pool while it runs: following `options.scale_file`, or `autoscaler`
    on the load of `members()` (each with `draining` and `in_flight`); None for neither."""
    if options.scale_file:
        return asyncio.ensure_future(
            follow_scale_file(Path(options.scale_file), options.poll_s, resize, what)
        )
    if autoscaler is None or options.max_in_flight is None:
        return None

    def load() -> tuple[int, int]:
        serving = [m for m in members() if not m.draining]
        return len(serving), sum(m.in_flight for m in serving)

    return asyncio.ensure_future(
        autoscaler.follow(options.poll_s, load, options.max_in_flight, resize)
    )
