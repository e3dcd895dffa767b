"""A `plait serve tinker` server on tiny-qwen3 for the tests, in a thread of this process (the
SDK runs in the test's thread), with two tenants."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plait.api import ResolvedModel, structure

BASE = "Qwen/Qwen3-tiny"  # the name clients use; the server maps it to tiny-qwen3
KEYS = {"alice": "tml-alice-key", "bob": "tml-bob-key"}
QUOTA_TENANT = {  # for the quota tests alone
    "name": "carol",
    "api_key": "tml-carol-key",
    "max_training_runs": 2,
    "max_sampling_sessions": 4,
}


@pytest.fixture(scope="session")
def base_model() -> str:
    return BASE


@pytest.fixture(scope="session")
def quota_tenant() -> dict[str, Any]:
    return QUOTA_TENANT


@pytest.fixture(scope="session")
def api_keys() -> dict[str, str]:
    return KEYS


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    pytest.importorskip("plait_torch", reason="needs the reference engine (plait-torch)")
    from plait_testing.models import materialize_model

    return materialize_model("tiny-qwen3", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3")


@pytest.fixture(scope="session")
def tinker_url(tinker_server: tuple[str, Any]) -> str:
    return tinker_server[0]


@pytest.fixture(scope="session")  # one per xdist worker: each test closes what it opens
def tinker_server(
    tiny_qwen3: ResolvedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Any]]:
    """(base URL, the server's TinkerApp)."""
    from plait_tinker.app import build_app
    from plait_tinker.config import TinkerServerConfig

    config = structure(
        TinkerServerConfig,
        {
            "models": {BASE: {"model": str(tiny_qwen3.path)}},
            "server": {
                "poll_s": 2.0,
                "max_samplers": 3,
                "session_timeout_s": 20.0,
                "dead_after_s": 3.0,
            },
            "tenants": [
                {"name": name, "api_key": key, "max_training_runs": 3} for name, key in KEYS.items()
            ]
            + [QUOTA_TENANT],
        },
    )
    app = build_app(config, tmp_path_factory.mktemp("tinker-storage"))
    started, url = threading.Event(), []
    stop: list[asyncio.Event] = []
    loop: list[asyncio.AbstractEventLoop] = []

    async def serve() -> None:
        stop.append(asyncio.Event())
        loop.append(asyncio.get_running_loop())
        async with app.serving("127.0.0.1", 0) as bound:
            url.append(bound)
            started.set()
            await stop[0].wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(60), "the server did not start"
    yield url[0], app
    loop[0].call_soon_threadsafe(stop[0].set)
    thread.join(60)


@pytest.fixture
def service_client(tinker_url: str):
    import tinker

    with tinker.ServiceClient(base_url=tinker_url, api_key=KEYS["alice"]) as client:
        yield client
