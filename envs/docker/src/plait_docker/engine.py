"""Connecting to the Docker engine: the one place that decides whether sandboxed execution is
possible.

There is no fallback: without a reachable engine nothing executes (untrusted code never runs on the
host), and the error says how to start one.
"""

from __future__ import annotations

import os

import docker
import docker.errors
import requests

from plait.api import EngineError

# Labels on everything plait-docker creates, so that the janitor can find leftovers.
LABEL_SANDBOX = "plait.sandbox"
LABEL_POOL = "plait.sandbox.pool"
LABEL_OWNER_PID = "plait.sandbox.owner-pid"
LABEL_OWNER_HOST = "plait.sandbox.owner-host"
LABEL_IMAGE = "plait.sandbox-image"
LABEL_RECIPE = "plait.sandbox-image.recipe"

START_ENGINE_FIX = (
    "start a Docker engine: as root, `apt-get install -y docker.io` and then `dockerd &` "
    "(or run `bash scripts/ci/docker.sh`, which also builds the sandbox image); "
    "or point DOCKER_HOST at a running engine"
)


def engine_address() -> str:
    return os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")


def connect(timeout_s: float = 60.0) -> docker.DockerClient:
    """A client for the engine at DOCKER_HOST (default: the local socket), checked with a ping.

    `timeout_s` bounds every HTTP call the client makes (exec output is streamed and bounded
    separately by the sandbox).
    """
    try:
        client = docker.from_env(timeout=int(timeout_s))
        client.ping()
    except (docker.errors.DockerException, requests.RequestException, OSError) as exc:
        raise EngineError(
            f"no Docker engine is reachable at {engine_address()} ({type(exc).__name__}: {exc}); "
            "plait-docker runs untrusted code only inside Docker containers, so it cannot execute "
            "anything",
            fix=START_ENGINE_FIX,
        ) from exc
    return client
