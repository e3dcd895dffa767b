"""A run's components: checked against the registry at config load, then built from it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs

from plait import kinds
from plait.config import CriticSection, PolicySection, RunConfig
from plait.errors import ConfigError, ModelError, UnknownComponentError
from plait.kinds import Critic
from plait.metrics import MetricSink
from plait.models import ResolvedModel, checkpoint_dir, materialized
from plait.plugins import Factory, Registry, get_registry
from plait.protocols import Environment, InferenceEngine, Renderer, TrainerEngine, WeightSync
from plait.rollout import Actor, DrivesEpisodes

F = TypeVar("F")


@attrs.define
class Policy:
    """One policy: what trains it, what samples from it, and how its weights get there."""

    name: str
    config: PolicySection
    model: ResolvedModel
    trainer: TrainerEngine
    engines: list[InferenceEngine]
    renderer: Renderer
    sync: WeightSync
    reference: InferenceEngine | None = None
    """The frozen engine that scores episodes for the KL penalty (`rl.kl.reference`)."""

    @property
    def actor(self) -> Actor:
        return self.engines[0], self.renderer


@attrs.define
class Components:
    """Everything a run is composed of, built from the config by the plugin registry."""

    policies: list[Policy]
    env: Environment
    sinks: list[MetricSink]
    critic: Critic | None = None

    def plays(self, policy: Policy, role: str) -> bool:
        """Whether `policy` plays `role`: it lists it, or it is the first and no policy lists it."""
        return role in policy.config.roles or (
            policy is self.policies[0] and not any(role in p.config.roles for p in self.policies)
        )

    def suffixed(self, policy: Policy, metrics: Mapping[str, float]) -> dict[str, float]:
        """`metrics` named for `policy` ("reward/mean@NAME") when the run has several policies."""
        if len(self.policies) == 1:
            return dict(metrics)
        return {f"{key}@{policy.name}": value for key, value in metrics.items()}

    def roles(self) -> dict[str, Actor]:
        """The actor of every role a policy lists (the first policy plays the others)."""
        return {role: p.actor for p in self.policies for role in p.config.roles}


def resolve_model(
    name: str, *, tokenizer: str | None = None, dtype: str = "float32"
) -> ResolvedModel:
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
            fix=exc.fix
            or "give a checkpoint directory, or install the plugin that registers the name",
        ) from None
    return materialized(name, factory.load(), tokenizer=tokenizer, dtype=dtype)


def _lookup(registry: Registry, kind: kinds.Kind[F], name: str) -> Factory[F]:
    try:
        return registry.get(kind, name)
    except UnknownComponentError as exc:
        raise ConfigError(kind.config_key, exc.message, fix=exc.fix) from None


def _policy_parts(
    p: PolicySection, at: str
) -> list[tuple[kinds.Kind[Any], str, Mapping[str, Any], str]]:
    """(kind, name, options, config key) of a policy's trainer, inference engine, renderer and
    sync."""
    return [
        (kinds.TRAINER_ENGINE, p.trainer.engine, p.trainer.options, f"{at}trainer"),
        (kinds.INFERENCE_ENGINE, p.inference.engine, p.inference.options, f"{at}inference"),
        (kinds.RENDERER, p.renderer.name, p.renderer.options, f"{at}renderer"),
        (kinds.WEIGHT_SYNC, p.sync.method, p.sync.options, f"{at}sync"),
    ]


def _checked(
    registry: Registry, kind: kinds.Kind[F], name: str, options: Mapping[str, Any], section: str
) -> tuple[Factory[F], Any]:
    """The factory registered as `name` and `options` validated against its options class."""
    factory = _lookup(registry, kind, name)
    return factory, factory.validate_options(options, f"{section}.options")


def _at(config: RunConfig, name: str) -> str:
    return f"policies.{name}." if config.policies else ""


def validate_components(config: RunConfig) -> None:
    """Check that every named component exists and that its options fit its options class, and
    that each role has one policy. Runs at config load so a typo fails in a second, not after the
    model has loaded."""
    registry = get_registry()
    checks: list[tuple[kinds.Kind[Any], str, Mapping[str, Any], str]] = []
    played: dict[str, str] = {}
    for index, (name, p) in enumerate(config.policy_sections().items()):
        if index and not p.roles:
            raise ConfigError(
                f"{_at(config, name)}roles",
                "this policy would never act: only the first policy "
                "plays the roles no policy lists",
                fix="list the environment roles it plays",
            )
        for role in p.roles:
            if played.setdefault(role, name) != name:
                raise ConfigError(
                    f"{_at(config, name)}roles",
                    f"role {role!r} is also played by policy {played[role]!r}",
                )
        checks += _policy_parts(p, _at(config, name))
    if config.critic is not None:
        if len(config.policies) > 1:
            raise ConfigError("critic", "a critic serves a run of one policy; this run has several")
        trainer = config.critic.trainer
        checks.append((kinds.TRAINER_ENGINE, trainer.engine, trainer.options, "critic.trainer"))
        _lookup(registry, kinds.LOSS, config.critic.loss)
    for check in [*checks, (kinds.ENV, config.env.name, config.env.options, "env")]:
        _checked(registry, *check)
    _lookup(registry, kinds.LOSS, config.rl.loss)
    _lookup(registry, kinds.ADVANTAGE, config.rl.advantage).validate_options(
        config.rl.advantage_options, "rl.advantage_options"
    )
    if config.off_policy.correction != "none":
        _lookup(registry, kinds.OFF_POLICY_CORRECTION, config.off_policy.correction)
    _lookup(registry, kinds.BATCH_PREPARER, config.rl.batch_preparer).load().check(config)
    for sink in config.metrics.sinks:
        _lookup(registry, kinds.METRIC_SINK, sink).validate_options(
            config.metrics.options.get(sink, {}), f"metrics.options.{sink}"
        )
    for sink in config.metrics.options:
        if sink not in config.metrics.sinks:
            raise ConfigError(
                f"metrics.options.{sink}",
                f"options for sink {sink!r}, which metrics.sinks does not list",
            )


def build_policy(name: str, p: PolicySection, seed: int, at: str, reference: bool) -> Policy:
    """`reference`: with a frozen second inference engine (`rl.kl.reference = "inference"`)."""
    registry = get_registry()
    model = resolve_model(p.model.name, tokenizer=p.model.tokenizer, dtype=p.model.dtype)
    (
        (trainer, trainer_options),
        (engine, engine_options),
        (renderer, renderer_options),
        (sync, sync_options),
    ) = [_checked(registry, *part) for part in _policy_parts(p, at)]
    return Policy(
        name,
        p,
        model,
        trainer.load()(model, options=trainer_options, seed=seed),
        [engine.load()(model, options=engine_options, seed=seed)],
        renderer.load()(model, options=renderer_options),
        sync.load()(options=sync_options),
        engine.load()(model, options=engine_options, seed=seed) if reference else None,
    )


def build_critic(c: CriticSection, seed: int) -> Critic:
    model = resolve_model(c.model.name, tokenizer=c.model.tokenizer, dtype=c.model.dtype)
    factory, options = _checked(
        get_registry(), kinds.TRAINER_ENGINE, c.trainer.engine, c.trainer.options, "critic.trainer"
    )
    return Critic(c, model, factory.load()(model, options=options, seed=seed))


def build_components(config: RunConfig, run_dir: Path) -> Components:
    registry = get_registry()
    make_env, env_options = _checked(
        registry, kinds.ENV, config.env.name, config.env.options, "env"
    )
    env = make_env.load()(options=env_options)
    if len(config.policies) > 1 and isinstance(env, DrivesEpisodes):
        raise ConfigError(
            "policies",
            f"env {config.env.name!r} runs its episodes itself, so it cannot hand "
            "turns to several policies",
            fix="use one policy, or run the environment in the controller",
        )
    policies = [
        build_policy(name, p, config.run.seed, _at(config, name), config.rl.kl.on_engine)
        for name, p in config.policy_sections().items()
    ]
    sinks = []
    for name in config.metrics.sinks:
        factory = _lookup(registry, kinds.METRIC_SINK, name)
        options = factory.validate_options(
            config.metrics.options.get(name, {}), f"metrics.options.{name}"
        )
        sinks.append(factory.load()(run_dir, options=options))
    critic = build_critic(config.critic, config.run.seed) if config.critic else None
    return Components(policies, env, sinks, critic)
