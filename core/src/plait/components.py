"""A run's components: checked against the registry at config load, then built from it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs

from plait import kinds
from plait.config import RunConfig
from plait.errors import ConfigError, ModelError, UnknownComponentError
from plait.metrics import MetricSink
from plait.models import ResolvedModel, checkpoint_dir, materialized
from plait.plugins import Factory, Registry, get_registry
from plait.protocols import Environment, InferenceEngine, Renderer, TrainerEngine, WeightSync

F = TypeVar("F")


@attrs.define
class Components:
    """Everything a run is composed of, built from the config by the plugin registry."""

    model: ResolvedModel
    trainer: TrainerEngine
    engines: list[InferenceEngine]
    renderer: Renderer
    env: Environment
    sync: WeightSync
    sinks: list[MetricSink]


def resolve_model(name: str, *, tokenizer: str | None = None, dtype: str = "float32") -> ResolvedModel:
    """A local checkpoint directory for `name`: a directory as it is, or a registered model
    name fetched or built once, then cached."""
    as_directory = checkpoint_dir(name, tokenizer=tokenizer, dtype=dtype)
    if as_directory is not None:
        return as_directory
    registry = get_registry()
    try:
        factory = registry.get(kinds.MODEL, name)
    except UnknownComponentError as exc:
        raise ModelError(
            f"model {name!r} is neither a directory nor a registered model name; "
            f"registered: {', '.join(registry.names(kinds.MODEL)) or '(none)'}",
            fix=exc.fix or "give a checkpoint directory, or install the plugin that registers the name",
        ) from None
    return materialized(name, factory.load(), tokenizer=tokenizer, dtype=dtype)


def _lookup(registry: Registry, kind: kinds.Kind[F], name: str) -> Factory[F]:
    try:
        return registry.get(kind, name)
    except UnknownComponentError as exc:
        raise ConfigError(kind.config_key, exc.message, fix=exc.fix) from None


def _checked(registry: Registry, kind: kinds.Kind[F], name: str, options: Mapping[str, Any],
             section: str) -> tuple[F, Any]:
    """The factory registered as `name` and `options` validated against its options class."""
    factory = _lookup(registry, kind, name)
    return factory.load(), factory.validate_options(options, f"{section}.options")


def validate_components(config: RunConfig) -> None:
    """Check that every named component exists and that its options fit its options class.

    Runs at config load so a typo fails in a second, not after the model has loaded.
    """
    registry = get_registry()
    checks: list[tuple[kinds.Kind[Any], str, Mapping[str, Any], str]] = [
        (kinds.TRAINER_ENGINE, config.trainer.engine, config.trainer.options, "trainer"),
        (kinds.INFERENCE_ENGINE, config.inference.engine, config.inference.options, "inference"),
        (kinds.RENDERER, config.renderer.name, config.renderer.options, "renderer"),
        (kinds.WEIGHT_SYNC, config.sync.method, config.sync.options, "sync"),
        (kinds.ENV, config.env.name, config.env.options, "env"),
    ]
    for kind, name, options, section in checks:
        _lookup(registry, kind, name).validate_options(options, f"{section}.options")
    _lookup(registry, kinds.LOSS, config.rl.loss)
    for sink in config.metrics.sinks:
        _lookup(registry, kinds.METRIC_SINK, sink).validate_options(
            config.metrics.options.get(sink, {}), f"metrics.options.{sink}")
    for sink in config.metrics.options:
        if sink not in config.metrics.sinks:
            raise ConfigError(f"metrics.options.{sink}", f"options for sink {sink!r}, which metrics.sinks does not list")


def build_components(config: RunConfig, run_dir: Path) -> Components:
    registry = get_registry()
    model = resolve_model(config.model.name, tokenizer=config.model.tokenizer, dtype=config.model.dtype)
    seed = config.run.seed
    make_trainer, trainer_options = _checked(registry, kinds.TRAINER_ENGINE, config.trainer.engine,
                                             config.trainer.options, "trainer")
    make_engine, engine_options = _checked(registry, kinds.INFERENCE_ENGINE, config.inference.engine,
                                           config.inference.options, "inference")
    make_renderer, renderer_options = _checked(registry, kinds.RENDERER, config.renderer.name,
                                               config.renderer.options, "renderer")
    make_env, env_options = _checked(registry, kinds.ENV, config.env.name, config.env.options, "env")
    make_sync, sync_options = _checked(registry, kinds.WEIGHT_SYNC, config.sync.method, config.sync.options, "sync")
    trainer = make_trainer(model, options=trainer_options, seed=seed)
    engine = make_engine(model, options=engine_options, seed=seed)
    renderer = make_renderer(model, options=renderer_options)
    env = make_env(options=env_options)
    sync = make_sync(options=sync_options)
    sinks = []
    for name in config.metrics.sinks:
        factory = _lookup(registry, kinds.METRIC_SINK, name)
        options = factory.validate_options(config.metrics.options.get(name, {}), f"metrics.options.{name}")
        sinks.append(factory.load()(run_dir, options=options))
    return Components(model, trainer, [engine], renderer, env, sync, sinks)
