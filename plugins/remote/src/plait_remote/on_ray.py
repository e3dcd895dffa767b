"""Services on a Ray cluster: a launched `plait serve ...` service placed on a node by Ray.

With `ray` set in the "remote" engines' options, the service is not started here but inside a
Ray actor (`ServiceHost`) that asks for the CPUs, GPUs and custom resources of its
`RayPlacement`, so Ray chooses the node (custom resources pin a pool to the nodes that have
them). On that node the actor starts the same `plait serve` command a local launch would, bound
to the node's address with an API key, and the engine talks to it over HTTP like to any service.
The files the command reads (its run config) are written on the node; the model and the weight
directories must be at the same paths on every node (one machine, or a shared disk).

A service that dies is seen through its actor (exit code, the log tail on its node), so the
inference engine launches it again as it does a local one; an actor or node that dies is an
`EngineError` that names both.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from plait.api import EngineError
from plait_remote.options import RayPlacement
from plait_server.engine import LaunchedServer, ServerProcess, free_port

log = structlog.get_logger("plait_remote.on_ray")

Command = Callable[[str, int], tuple[list[str], dict[str, str]]]
"""(host, port) -> (argv, environment) of the service to start."""

POLL_EVERY_S = 0.5
"""How long an answer of the actor about its service stands (engines ask before every request)."""


_joined_as: str | None = None
"""The address this process joined its cluster by (through `connect`)."""


def connect(placement: RayPlacement) -> None:
    """Join the cluster at `placement.address` (None: start a local one for this run), once. A
    process is part of one Ray cluster: services on another are reached by URL."""
    global _joined_as
    import ray

    wanted = placement.address
    if ray.is_initialized():
        joined = ray.get_runtime_context().gcs_address
        if wanted in (None, "auto", _joined_as, joined):
            return
        raise EngineError(
            f"this process is connected to the Ray cluster at {joined}, and a process joins one "
            f"Ray cluster: it cannot place a service on {wanted}",
            fix="give every component of the run the same ray.address, and reach services on "
            "another cluster over HTTP: start them there with plait serve and set options.url",
        )
    try:
        ray.init(
            address=wanted,
            namespace=placement.namespace,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise EngineError(
            f"cannot reach the Ray cluster at {wanted!r}: {exc}",
            fix="start it (ray start --head) or correct ray.address; leave it unset to start a "
            "local cluster for the run",
        ) from exc
    _joined_as = wanted


class ServiceHost:
    """The Ray actor that holds one service process on its node."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.server: ServerProcess | None = None

    def where(self) -> tuple[str, int, str, str]:
        """(this node's address, a free port on it, the node's id, this actor's id)."""
        import ray

        address, context = ray.util.get_node_ip_address(), ray.get_runtime_context()
        return address, free_port(address), context.get_node_id(), str(context.get_actor_id())

    def start(self, argv: list[str], env: dict[str, str], files: dict[str, str]) -> tuple[int, str]:
        """Write `files`, start the command; (its pid, its log's path on this node)."""
        for path, text in files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
        log_path = os.path.join(
            tempfile.gettempdir(), f"plait-{self.name.replace(' ', '-')}-{os.getpid()}.log"
        )
        self.server = ServerProcess(self.name, argv, log_path=log_path, env=env)
        return self.server.pid, log_path

    def exit_code(self) -> int | None:
        """None while the service runs."""
        assert self.server is not None
        return self.server.exit_code

    def log_tail(self, lines: int) -> str:
        return self.server.log_tail(lines) if self.server is not None else "(not started)"

    def stop(self, grace_s: float) -> None:
        if self.server is not None:
            self.server.stop(grace_s)


class RayServer(LaunchedServer):
    """A service started by a `ServiceHost` actor on the node Ray chose."""

    def __init__(
        self,
        name: str,
        placement: RayPlacement,
        command: Command,
        *,
        files: dict[str, str],
        timeout_s: float,
    ) -> None:
        import ray
        from ray.exceptions import GetTimeoutError

        connect(placement)
        self.name = name
        self.placement = placement
        host: Any = ray.remote(ServiceHost)  # typed loosely: Ray's actor stubs lose the methods
        self.actor: Any = host.options(
            num_cpus=placement.num_cpus,
            num_gpus=placement.num_gpus,
            resources=dict(placement.resources),
            max_restarts=0,
        ).remote(name)
        self._exit_code: int | None = None
        self._actor_failure: str | None = None
        try:
            address, port, node_id, self.actor_id = ray.get(
                self.actor.where.remote(), timeout=timeout_s
            )
        except GetTimeoutError:
            ray.kill(self.actor)
            raise EngineError(
                f"no node of the Ray cluster took the {name} within {timeout_s:g} s: it asks for "
                f"{self._request()}; the cluster has {ray.cluster_resources()}, "
                f"free now {ray.available_resources()}",
                fix="ask for resources a node has (options.ray), add a node that has them, "
                "or raise startup_timeout_s",
            ) from None
        self.address, self.node_id = address, node_id
        self.location = f" (Ray actor {self.actor_id[:12]} on node {node_id[:12]} at {address})"
        self.log_path = Path("(not started)")
        argv, env = command(address, port)
        self.pid, log_path = self._get(self.actor.start.remote(argv, env, files), timeout_s=60.0)
        self.log_path = Path(log_path)
        self.url = f"http://{address}:{port}"
        self._checked = time.monotonic()
        log.info(
            "service started on Ray", server=name, node=node_id[:12], url=self.url, log=log_path
        )

    def _request(self) -> str:
        p = self.placement
        return f"num_cpus={p.num_cpus:g}, num_gpus={p.num_gpus:g}, resources={dict(p.resources)}"

    def _get(self, ref: Any, *, timeout_s: float) -> Any:
        import ray
        from ray.exceptions import RayActorError

        try:
            return ray.get(ref, timeout=timeout_s)
        except RayActorError as exc:
            self._died(exc)
            raise self.crash_error() from None

    def _died(self, exc: Exception) -> None:
        self._actor_failure = str(exc).strip().splitlines()[0][:300]

    def alive(self) -> bool:
        if self._actor_failure is not None or self._exit_code is not None:
            return False
        if time.monotonic() - self._checked >= POLL_EVERY_S:
            import ray

            try:
                self._exit_code = ray.get(self.actor.exit_code.remote(), timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                self._died(exc)
            self._checked = time.monotonic()
        return self._actor_failure is None and self._exit_code is None

    @property
    def exit_code(self) -> int | None:
        return self._exit_code

    def log_tail(self, lines: int = 30) -> str:
        import ray

        try:
            return str(ray.get(self.actor.log_tail.remote(lines), timeout=30))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return (
                f"(the log is on node {self.node_id[:12]} at {self.address}, "
                "and its actor does not answer)"
            )

    def how_it_ended(self) -> str:
        if self._actor_failure is None:
            return super().how_it_ended()
        return f"died with its Ray actor{self.location}: {self._actor_failure}"

    def stop(self, grace_s: float = 15.0) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(grace_s), timeout=grace_s + 15)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # the actor is gone, and its service with it (it dies with the actor's process)
        finally:
            ray.kill(self.actor)
