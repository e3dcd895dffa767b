"""Options of the "remote" trainer and inference engines and of the "pool" inference engine."""

from __future__ import annotations

from typing import Any

import attrs

from plait.api import positive
from plait_remote.scale import AutoscaleOptions
from plait_server.engine import ServerOptions


@attrs.frozen
class RayPlacement:
    """A launched service in a Ray actor, on the node Ray picks for this request (see
    plait_remote.on_ray). The model and weight directories must be at the same paths there."""

    address: str | None = None
    """The cluster: "auto" (the one `ray start` made this machine part of), "ray://HOST:10001", an
    IP:port; None starts a local cluster for the run (unless the process is connected already)."""
    num_cpus: float = attrs.field(default=1.0, validator=attrs.validators.ge(0))
    num_gpus: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    resources: dict[str, float] = attrs.field(factory=dict)
    """Custom resources, e.g. {inference_pool = 1}: only nodes started with them take the
    service."""
    namespace: str = "plait"


@attrs.frozen
class RemoteOptions(ServerOptions):
    """`url` attaches to a running `plait serve inference`; without it the engine launches one
    (with `python`, default this interpreter) that runs `engine` with `engine_options`, and
    launches it again with its weights if it dies; `ray` launches it on a Ray cluster instead of
    this machine."""

    engine: str = "torch"
    """The inference engine the launched service runs (any installed one but "remote")."""
    engine_options: dict[str, Any] = attrs.field(factory=dict)
    """That engine's options (its `inference.options`)."""
    ray: RayPlacement | None = None
    keepalive_s: float = attrs.field(default=30.0, validator=positive)
    """How long an idle connection to the service is kept: plait's services keep theirs 60 s, so
    a step's requests reuse the last step's connections (with 1 s, every step opened one per
    request). Behind anything that drops idle connections sooner (uvicorn's default: 5 s), set it
    below that."""


@attrs.frozen
class RemoteTrainerOptions:
    """`url` attaches to a running `plait serve trainer` (the run creates its own trainer there);
    without it the engine launches one (with `python`, default this interpreter) that runs
    `engine` with `engine_options`. A trainer service that dies fails the run with its log: resume
    from the last checkpoint (`plait run` resumes by default). `ray` launches it on a Ray cluster
    instead of this machine."""

    url: str | None = None
    engine: str = "torch"
    """The trainer engine the service runs (any installed one but "remote")."""
    engine_options: dict[str, Any] = attrs.field(factory=dict)
    """That engine's options (its `trainer.options`)."""
    ray: RayPlacement | None = None
    python: str | None = None
    host: str = "127.0.0.1"
    port: int | None = None
    """None = a free port."""
    api_key: str | None = None
    env: dict[str, str] = attrs.field(factory=dict)
    """Extra environment variables for a launched service."""
    startup_timeout_s: float = attrs.field(default=600.0, validator=positive)
    request_timeout_s: float = attrs.field(default=3600.0, validator=positive)
    """Deadline of one call (a forward_backward of a large batch on a slow machine)."""
    log_path: str | None = None
    """Where a launched service's output goes; None = a file in the temporary directory (logged)."""
    exchange_dir: str | None = None
    """Where the service writes exported weights for the run to read (a disk both see); None = a
    temporary directory."""


@attrs.frozen
class ReplicaSpec:
    """`count` replicas of inference engine `engine` with `options` (its `inference.options`)."""

    engine: str = "remote"
    options: dict[str, Any] = attrs.field(factory=dict)
    count: int = attrs.field(default=1, validator=attrs.validators.ge(0))


@attrs.frozen
class PoolOptions:
    """`replicas`: what the pool starts with, e.g. [{engine = "remote",
    options = {engine = "torch"}, count = 2}, {engine = "vllm", options = {...}}]. Scaling up
    repeats the last spec."""

    replicas: list[ReplicaSpec] = attrs.field(factory=lambda: [ReplicaSpec()])
    max_in_flight: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive)
    )
    """Requests one replica runs at once (None = no cap); others wait for room."""
    max_reissues: int = attrs.field(default=3, validator=attrs.validators.ge(0))
    scale_file: str | None = None
    """A JSON file `{"replicas": n}` the pool reads every `poll_s` seconds and scales to."""
    poll_s: float = attrs.field(default=1.0, validator=positive)
    autoscale: AutoscaleOptions | None = None
    """Size the pool by its queue instead (needs `max_in_flight`): requests that wait for room
    add a replica, a calm pool drains one (plait_remote.scale)."""


@attrs.frozen
class EnvPoolOptions:
    """`members` ORS servers of environment `env` (with `env_options`), each a `plait env serve`
    process (or a `plait serve rollout` worker, with `rollout_config`) launched by the run (on this
    machine, or on Ray with `ray`); an episode runs on the member with the most room, at most
    `max_in_flight` at once on each."""

    env: str = "math.arith"
    env_options: dict[str, Any] = attrs.field(factory=dict)
    members: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    max_in_flight: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive)
    )
    """Episodes one member runs at once (its capacity: a slow verifier, a sandbox pool); None = no
    cap."""
    scale_file: str | None = None
    """A JSON file `{"replicas": n}` the pool reads every `poll_s` seconds and scales to
    (`plait scale`)."""
    poll_s: float = attrs.field(default=1.0, validator=positive)
    autoscale: AutoscaleOptions | None = None
    """Size the pool by its queue instead (needs `max_in_flight`): episodes that wait for room
    add a member, a calm pool drains one (plait_remote.scale)."""
    ray: RayPlacement | None = None
    python: str | None = None
    """The interpreter that runs the members (None: this one)."""
    startup_timeout_s: float = attrs.field(default=120.0, validator=positive)
    rollout_config: str | None = None
    """A run config (usually this run's own file): the members are then `plait serve rollout`
    workers of its [model] and [renderer] (with `env` and `env_options` as their [env]), each
    running whole episodes next to its environment and sampling from the run's inference
    service (inference.engine = "remote"). The file must be at this path wherever a member runs."""
