"""500 executions with random timeouts and client-side cancellations leave nothing behind,
as the engine's API reports it: no container, no volume, no process."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from plait_docker.image import DEFAULT_RECIPE
from plait_docker.sandbox import Sandbox, SandboxOptions

pytestmark = [pytest.mark.docker, pytest.mark.slow]

EXECUTIONS = 500
CONCURRENCY = 4  # modest: the test machine has two cores

PROGRAMS = [
    "print(sum(range(1000)))",
    "import time\ntime.sleep({sleep})\nprint('slept')",
    "import subprocess\nsubprocess.Popen(['sleep', '100'])\nprint('left a child')",
    "import sys\nsys.stdout.write('x' * 200000)",
    "raise ValueError('boom')",
    "open('scratch', 'w').write('data')\nprint(open('scratch').read())",
]


def host_processes_of(uid: int) -> list[int]:
    """PIDs on this host (container processes included) owned by `uid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                pass
    return found


async def soak(sandbox: Sandbox, rng: random.Random) -> dict[str, int]:
    counts: dict[str, int] = {}
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def one(index: int) -> None:
        code = rng.choice(PROGRAMS).format(sleep=round(rng.uniform(0, 1.5), 2))
        timeout = round(rng.uniform(0.3, 2.0), 2)
        cancel_after = rng.uniform(0.05, 1.0) if rng.random() < 0.2 else None
        async with semaphore:
            task = asyncio.create_task(sandbox.run(code, timeout_s=timeout))
            if cancel_after is not None:
                await asyncio.sleep(cancel_after)
                task.cancel()
            try:
                result = await task
                key = result.reason
            except asyncio.CancelledError:
                key = "cancelled_by_client"
        counts[key] = counts.get(key, 0) + 1

    await asyncio.gather(*(one(i) for i in range(EXECUTIONS)))
    return counts


def test_soak_leaves_nothing_behind(engine):
    volumes_before = engine.volume_names()
    sandbox = Sandbox(SandboxOptions(pool_size=2))
    counts = asyncio.run(soak(sandbox, random.Random(1234)))
    print("outcomes:", counts)
    assert sum(counts.values()) == EXECUTIONS
    for reason in ("ok", "timeout", "error", "background_processes", "cancelled_by_client"):
        assert counts.get(reason, 0) > 0, counts
    assert "sandbox_error" not in counts, counts

    # While the pool is open: only its warm containers, with nothing of the sandbox user running.
    containers = engine.pool_containers(sandbox.pool_id)
    assert 1 <= len(containers) <= 2
    for container in containers:
        assert engine.sandbox_user_processes(container) == []
    assert sandbox.execute("print('still works')").stdout == "still works\n"

    sandbox.close()
    assert engine.pool_containers(sandbox.pool_id) == []
    assert engine.volume_names() == volumes_before
    assert host_processes_of(DEFAULT_RECIPE.sandbox_uid) == []
    assert host_processes_of(DEFAULT_RECIPE.init_uid) == []
