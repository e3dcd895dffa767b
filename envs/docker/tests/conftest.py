"""Fixtures for the tests that need a running Docker engine (marked `docker`).

They use the real engine and the real sandbox image: start both with `bash scripts/ci/docker.sh`.
"""

from __future__ import annotations

import pytest

from plait_docker.engine import LABEL_POOL, LABEL_SANDBOX, connect
from plait_docker.image import DEFAULT_RECIPE


class Engine:
    """What the engine's API says about sandbox containers, volumes and processes."""

    def __init__(self) -> None:
        self.client = connect()

    def pool_containers(self, pool_id: str) -> list:
        return self.client.containers.list(all=True, filters={"label": f"{LABEL_POOL}={pool_id}"})

    def sandbox_containers(self) -> list:
        return self.client.containers.list(all=True, filters={"label": f"{LABEL_SANDBOX}=1"})

    def volume_names(self) -> set[str]:
        return {v.name for v in self.client.volumes.list()}

    @staticmethod
    def sandbox_user_processes(container) -> list[list[str]]:
        """The processes of the sandbox user in `container` (the engine's `top`)."""
        top = container.top()
        uid_column = top["Titles"].index("UID")
        return [
            row for row in top["Processes"] if row[uid_column] == str(DEFAULT_RECIPE.sandbox_uid)
        ]


@pytest.fixture(scope="session")
def engine() -> Engine:
    return Engine()
