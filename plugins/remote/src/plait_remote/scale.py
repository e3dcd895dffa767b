"""Pools that change size while a run goes: `plait scale RUN_DIR inference=N env=M`, and the
scale file the pools follow.

The run's config (RUN_DIR/config.toml, written when it started) names each pool's `scale_file`;
the command writes `{"replicas": N}` there (atomically) and the pool, which reads it every
`poll_s` seconds, grows (an inference replica gets the newest weights before it serves) or
drains its newest members (they finish what they run, take nothing new, and leave).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tomllib
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import structlog

from plait.errors import ConfigError, PlaitError

log = structlog.get_logger("plait_remote")

SCALABLE = {"inference": "engine", "env": "name"}
"""The config sections whose component can be a "pool", and the key that names the component."""


def scale_file_of(run_dir: Path, section: str) -> tuple[Path, float]:
    """(the scale file the run's `section` pool reads, how often it reads it)."""
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise ConfigError("RUN_DIR", f"{run_dir} holds no config.toml, so it is not a run's directory",
                          fix="give the directory `plait run` printed at its start (out_dir/name)")
    table, key = tomllib.loads(config_path.read_text()).get(section, {}), SCALABLE[section]
    if table.get(key) != "pool":
        raise ConfigError(f"{section}.{key}", f"the run in {run_dir} has {section}.{key} = {table.get(key)!r}, "
                                              f"and only a pool scales",
                          fix=f'start the run with {section}.{key} = "pool" and {section}.options.scale_file set')
    options = table.get("options") or {}
    if not options.get("scale_file"):
        raise ConfigError(f"{section}.options.scale_file", f"the {section} pool of the run in {run_dir} reads no scale file",
                          fix=f'start the run with {section}.options.scale_file = "{run_dir / f"{section}-scale.json"}"')
    return Path(options["scale_file"]).expanduser(), float(options.get("poll_s", 1.0))


def scale(run_dir: Path, section: str, replicas: int) -> Path:
    """Ask the run's `section` pool for `replicas` members; the scale file written."""
    if replicas < 1:
        raise ConfigError(section, f"a pool needs at least one member, asked for {replicas}",
                          fix="ask for 1 or more")
    path, _ = scale_file_of(run_dir, section)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps({"replicas": replicas}))
    os.replace(partial, path)  # the pool never reads half a file
    return path


async def follow_scale_file(path: Path, poll_s: float, resize: Callable[[int], Awaitable[None]], what: str) -> None:
    """Every `poll_s` seconds, `resize(n)` when `{"replicas": n}` in `path` changes (until cancelled).
    A missing or unreadable file is waited for; a resize that fails is logged, and tried again
    when the file asks for something else."""
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


def drain(members: Sequence[Any], retire: Callable[[Any], Awaitable[None]], tasks: set[asyncio.Task[None]]) -> None:
    """Mark `members` draining (they take no new work) and retire each, newest first, in a task
    kept in `tasks` until it is done (a pool cancels what is left when it closes)."""
    for member in reversed(members):
        member.draining = True
        task = asyncio.ensure_future(retire(member))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
