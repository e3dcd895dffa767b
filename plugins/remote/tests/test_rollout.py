"""Rollout workers (`plait serve rollout`): a worker runs the episodes the controller would run
itself, token for token; what goes wrong costs one trajectory with its reason; a pool of workers
spreads episodes and loses only a killed worker's running ones."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import tomli_w

from plait.api import ConfigError, EpisodeConfig, ResolvedModel, SamplingParams, run_episode
from plait_remote.rollout_service import RolloutWorkerEnv, build_worker
from plait_sdk.client import ORSOptions

pytestmark = pytest.mark.slow

ARITH = {"name": "math.arith", "options": {"preset": "tiny"}}


@pytest.fixture(scope="module")
def worker_config(tiny_model: ResolvedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rollout") / "run.toml"
    path.write_text(
        tomli_w.dumps(
            {
                "model": {"name": str(tiny_model.path)},
                "renderer": {
                    "name": "chat_template",
                    "options": {"template_kwargs": {"enable_thinking": False}},
                },
                "env": ARITH,
            }
        )
    )
    return path


def start_worker(config: Path, log: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    from plait_server.engine import free_port

    port = free_port()
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "plait.cli",
                "serve",
                "rollout",
                str(config),
                "--port",
                str(port),
                *args,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert worker.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return worker, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the rollout worker did not start"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def worker_url(worker_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    worker, url = start_worker(worker_config, tmp_path_factory.mktemp("logs") / "worker.log")
    yield url
    worker.terminate()
    worker.wait(30)


def episode_config(seed: int) -> EpisodeConfig:
    return EpisodeConfig(sampling=SamplingParams(max_tokens=16, temperature=1.0, seed=seed))


def test_a_worker_runs_the_episodes_the_controller_would_token_for_token(
    worker_config: Path, worker_url: str, make_attached: Callable[..., object]
) -> None:
    local = build_worker(worker_config, (), api_key=None)
    engine = make_attached()

    async def both() -> tuple[list, list, tuple[float, float]]:
        tasks = [await local.env.get_task("train", i) for i in range(6)]
        here = [
            await run_episode(local.env, task, engine, local.renderer, episode_config(i))
            for i, task in enumerate(tasks)
        ]
        worker = RolloutWorkerEnv(ORSOptions(url=worker_url))
        started = time.perf_counter()
        there = await asyncio.gather(
            *(
                run_episode(worker, task, engine, local.renderer, episode_config(i))
                for i, task in enumerate(tasks)
            )
        )
        window = (started, time.perf_counter())
        assert await worker.get_task("train", 3) == tasks[3]  # the worker serves its tasks over ORS
        await worker.close()
        await engine.close()
        return here, list(there), window

    here, there, (started, ended) = asyncio.run(both())
    assert [t.error for t in there] == [None] * 6
    assert [[turn.completion.tokens for turn in t.turns] for t in there] == [
        [turn.completion.tokens for turn in t.turns] for t in here
    ]
    assert [[turn.prompt for turn in t.turns] for t in there] == [
        [turn.prompt for turn in t.turns] for t in here
    ]
    assert [(t.reward, t.correct, t.finished) for t in there] == [
        (t.reward, t.correct, t.finished) for t in here
    ]
    # the worker's environment timings, moved onto this process's clock, fall within the calls
    intervals = [iv for t in there for iv in t.env_seconds]
    assert intervals and all(started - 0.05 <= a <= b <= ended + 0.05 for a, b in intervals)


def test_what_goes_wrong_costs_one_trajectory_or_names_the_fix(
    worker_config: Path, worker_url: str, make_attached: Callable[..., object]
) -> None:
    local = build_worker(worker_config, (), api_key=None)

    async def go() -> None:
        task = await local.env.get_task("train", 0)
        with pytest.raises(ConfigError, match=r'inference\.engine = "remote"'):
            await RolloutWorkerEnv(ORSOptions(url=worker_url)).run_episode(
                task, object(), local.renderer, episode_config(0)
            )
        from plait_server.engine import free_port

        nobody = RolloutWorkerEnv(ORSOptions(url=f"http://127.0.0.1:{free_port()}"))
        lost = await nobody.run_episode(task, make_attached(), local.renderer, episode_config(0))
        assert lost.turns == () and "the rollout worker at" in (lost.error or "")

    asyncio.run(go())
    refused = httpx.post(
        f"{worker_url}/rollout/episode", json={"task": {}, "inference": {"url": "x"}}
    )
    assert refused.status_code == 400 and "'config'" in refused.json()["error"]["message"]
    with pytest.raises(ConfigError, match=r"env\.name"):
        build_worker(worker_config, ("env.name=pool",), api_key=None)


def test_a_pool_of_workers_spreads_episodes_and_a_killed_one_costs_only_its_running_ones(
    worker_config: Path, make_attached: Callable[..., object]
) -> None:
    from plait_remote.env_pool import EnvPool
    from plait_remote.options import EnvPoolOptions

    local = build_worker(worker_config, (), api_key=None)
    pool = EnvPool(
        EnvPoolOptions(
            env="math.arith",
            env_options={"preset": "tiny"},
            members=2,
            max_in_flight=2,
            rollout_config=str(worker_config),
        )
    )
    engine = make_attached()

    async def go() -> list:
        tasks = [await pool.get_task("train", i) for i in range(12)]
        victim = pool.members[1]
        running = asyncio.gather(
            *(
                pool.run_episode(task, engine, local.renderer, episode_config(i))
                for i, task in enumerate(tasks)
            )
        )
        while victim.in_flight < 2:
            await asyncio.sleep(0.005)
        os.kill(victim.server.pid, signal.SIGKILL)
        done = await running
        assert victim not in pool.members and len(pool.members) == 1
        await pool.close()
        await engine.close()
        return list(done)

    done = asyncio.run(go())
    failed = [t for t in done if t.error]
    assert 1 <= len(failed) <= 2 and all("rollout worker" in (t.error or "") for t in failed)
    assert all(t.turns for t in done if not t.error) and len(done) == 12
