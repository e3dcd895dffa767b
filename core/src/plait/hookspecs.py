"""plait's hook specifications.

A plugin is a module with functions marked `@hookimpl` whose names match the specs below, made
known through the `plait` entry-point group:

    [project.entry-points.plait]
    myplugin = "my_package.plugin"

Every `plait_register_*` hook hands the plugin a `register` callback:

    register(name, target, *, options=None, description="")

`target` is a callable or a lazy "module:attribute" string that is imported on first use, so that
discovering plugins never imports torch, vLLM or Megatron. `options` is an attrs class (or a lazy
"module:Class" string) that validates the component's `options` table in a run config.

What each kind's factory is called with:

- trainer engines: `factory(model: ResolvedModel, *, options, seed: int) -> TrainerEngine`
- inference engines: `factory(model: ResolvedModel, *, options, seed: int) -> InferenceEngine`
- weight syncs: `factory(*, options) -> WeightSync`
- renderers: `factory(model: ResolvedModel, *, options) -> Renderer`
- environments: `factory(*, options) -> Environment`
- losses: the target *is* the loss function (see `plait.losses`)
- metric sinks: `factory(run_dir: Path, *, options) -> MetricSink`
- models: the target is a `plait.models.ModelSource`
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("plait")
hookimpl = pluggy.HookimplMarker("plait")


@hookspec
def plait_register_trainer_engines(register: Any) -> None:
    """Register trainer engines (the `trainer.engine` names)."""


@hookspec
def plait_register_inference_engines(register: Any) -> None:
    """Register inference engines (the `inference.engine` names)."""


@hookspec
def plait_register_weight_syncs(register: Any) -> None:
    """Register weight-sync methods (the `sync.method` names)."""


@hookspec
def plait_register_renderers(register: Any) -> None:
    """Register renderers / chat templates (the `renderer.name` names)."""


@hookspec
def plait_register_envs(register: Any) -> None:
    """Register environments (the `env.name` names, conventionally "<plugin>.<env>")."""


@hookspec
def plait_register_losses(register: Any) -> None:
    """Register loss functions (the `rl.loss` names)."""


@hookspec
def plait_register_metric_sinks(register: Any) -> None:
    """Register metric sinks (the `metrics.sinks` names)."""


@hookspec
def plait_register_models(register: Any) -> None:
    """Register model names that `model.name` resolves (see `plait.models.ModelSource`)."""


@hookspec
def plait_register_commands(cli: Any) -> None:
    """Add sub-commands to the `plait` CLI (a click group)."""
