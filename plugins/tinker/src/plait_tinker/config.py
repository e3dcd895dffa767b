"""The `plait serve tinker` config: which local models serve which base-model names, the engines
that train and sample them, where checkpoints live, and the tenants with their keys and quotas.

    [server]
    storage = "tinker-runs"            # checkpoints and run records
    [models."Qwen/Qwen3-0.6B"]         # the name clients pass as base_model
    model = "tiny-qwen3"               # a plait model name or a checkpoint directory
    [trainer]                          # an engine that can open LoRA adapters (plait-torch)
    engine = "torch"
    [inference]                        # an engine that takes options.adapter (plait-torch)
    engine = "torch"
    [[tenants]]
    name = "alice"
    api_key = "tml-alice-..."
    max_training_runs = 4
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from plait.api import (
    INFERENCE_ENGINE,
    TRAINER_ENGINE,
    ConfigError,
    Kind,
    UnknownComponentError,
    apply_overrides,
    get_registry,
    positive,
    structure,
)


@attrs.frozen
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    storage: str = "tinker-runs"
    """Directory of saved states, sampler weights and run records (relative: to the config file)."""
    lora_alpha: float = attrs.field(default=32.0, validator=positive)
    """Tinker's lora_config has no alpha: every adapter scales by lora_alpha / rank."""
    max_samplers: int = attrs.field(default=4, validator=positive)
    """Sampling engines kept loaded (one per sampled checkpoint, least recently used closed
    first)."""
    poll_s: float = attrs.field(default=25.0, validator=positive)
    """How long a retrieve_future waits for its result before answering 408 (the SDK gives up at
    45 s)."""
    session_timeout_s: float = attrs.field(default=60.0, validator=positive)
    """A session that sends nothing for this long (the SDK sends a heartbeat every 10 s) is
    finished: its queued work is cancelled, its training runs unload and its sampling clients
    are released."""
    abandon_s: float = attrs.field(default=0.5, validator=positive)
    """A request whose client dropped its poll and did not poll again within this long is
    cancelled (a killed client's sampling stops)."""
    dead_after_s: float = attrs.field(default=15.0, validator=positive)
    """A session that abandoned a request and then sends nothing (not even its 10 s heartbeat)
    for this long is dead: finished as if it had timed out."""
    max_training_runs: int = attrs.field(default=8, validator=positive)
    """Training runs each tenant may hold loaded at once, unless its [[tenants]] entry says
    otherwise (without [[tenants]]: the one tenant's)."""
    max_sampling_sessions: int = attrs.field(default=64, validator=positive)
    """Sampling clients each tenant may hold at once, likewise. At the cap, the tenant's least
    recently used idle one is released for a new one."""


@attrs.frozen
class BaseModel:
    model: str
    """A registered plait model name or a checkpoint directory."""
    tokenizer: str | None = None
    """What get_info reports as tokenizer_id, which the SDK's TrainingClient.get_tokenizer loads
    with transformers (default: the served model's tokenizer directory, which loads offline on
    this machine; name a hub id or a path the clients have when they run elsewhere)."""
    max_context_length: int = attrs.field(default=4096, validator=positive)


@attrs.frozen
class Component:
    engine: str = "torch"
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Tenant:
    name: str
    api_key: str
    max_training_runs: int | None = attrs.field(default=None, validator=positive)
    """Training runs loaded at once (a finished session's runs no longer count); default:
    server.max_training_runs."""
    max_sampling_sessions: int | None = attrs.field(default=None, validator=positive)
    """Default: server.max_sampling_sessions."""


@attrs.frozen
class TinkerServerConfig:
    models: dict[str, BaseModel]
    server: ServerOptions = attrs.field(factory=ServerOptions)
    trainer: Component = attrs.field(factory=Component)
    inference: Component = attrs.field(factory=Component)
    tenants: list[Tenant] = attrs.field(factory=list)
    """None listed: one tenant, any key, and the server binds loopback only."""

    def __attrs_post_init__(self) -> None:
        if not self.models:
            raise ConfigError(
                "models", 'no base model: add a [models."NAME"] table with model = ...'
            )
        for key in ("name", "api_key"):
            seen: set[str] = set()
            for i, tenant in enumerate(self.tenants):
                if getattr(tenant, key) in seen:
                    raise ConfigError(
                        f"tenants[{i}].{key}", f"{getattr(tenant, key)!r} appears twice"
                    )
                seen.add(getattr(tenant, key))


def check_components(config: TinkerServerConfig) -> None:
    """The trainer and inference engines exist and their options fit, before any model loads."""
    registry = get_registry()
    checks: list[tuple[str, Component, Kind[Any]]] = [
        ("trainer", config.trainer, TRAINER_ENGINE),
        ("inference", config.inference, INFERENCE_ENGINE),
    ]
    for section, component, kind in checks:
        try:
            factory = registry.get(kind, component.engine)
        except UnknownComponentError as exc:
            raise ConfigError(f"{section}.engine", exc.message, fix=exc.fix) from None
        factory.validate_options(component.options, f"{section}.options")


def load_server_config(
    path: Path | None, overrides: Sequence[str] = ()
) -> tuple[TinkerServerConfig, Path]:
    """The config (`key.path=value` overrides applied) and the directory its relative paths
    start from."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError("", f"cannot read the config {path}: {exc}") from None
    return structure(TinkerServerConfig, apply_overrides(data, overrides)), (
        path.parent if path else Path.cwd()
    )
