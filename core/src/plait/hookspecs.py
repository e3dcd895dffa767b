"""plait's hook specifications.

A plugin is a module with functions marked `@hookimpl` whose names match the specs below, made
known through the `plait` entry-point group:

    [project.entry-points.plait]
    myplugin = "my_package.plugin"

Every `plait_register_*` hook hands the plugin a typed `register` callback (`plait.kinds`):

    register(name, target, *, options=None, description="")

`target` is the factory, or a lazy "module:attribute" string imported on first use, so that
discovering plugins never imports torch, vLLM or Megatron. `options` is an attrs class (or a lazy
"module:Class" string) that validates the component's `options` table in a run config. The
factory types (what each kind's factory is called with and returns) are in `plait.kinds`.
"""

from __future__ import annotations

import click
import pluggy

from plait.kinds import (
    RegisterAdvantage,
    RegisterBatchPreparer,
    RegisterEnv,
    RegisterInferenceEngine,
    RegisterLoss,
    RegisterMetricSink,
    RegisterModel,
    RegisterOffPolicyCorrection,
    RegisterRenderer,
    RegisterTrainerEngine,
    RegisterWeightSync,
)

hookspec = pluggy.HookspecMarker("plait")
hookimpl = pluggy.HookimplMarker("plait")


@hookspec
def plait_register_trainer_engines(register: RegisterTrainerEngine) -> None:
    """Register trainer engines (the `trainer.engine` names)."""


@hookspec
def plait_register_inference_engines(register: RegisterInferenceEngine) -> None:
    """Register inference engines (the `inference.engine` names)."""


@hookspec
def plait_register_weight_syncs(register: RegisterWeightSync) -> None:
    """Register weight-sync methods (the `sync.method` names)."""


@hookspec
def plait_register_renderers(register: RegisterRenderer) -> None:
    """Register renderers / chat templates (the `renderer.name` names)."""


@hookspec
def plait_register_envs(register: RegisterEnv) -> None:
    """Register environments (the `env.name` names, conventionally "<plugin>.<env>")."""


@hookspec
def plait_register_losses(register: RegisterLoss) -> None:
    """Register loss functions (the `rl.loss` names)."""


@hookspec
def plait_register_advantages(register: RegisterAdvantage) -> None:
    """Register advantage estimators (the `rl.advantage` names)."""


@hookspec
def plait_register_off_policy_corrections(register: RegisterOffPolicyCorrection) -> None:
    """Register off-policy corrections (the `off_policy.correction` names besides "none")."""


@hookspec
def plait_register_batch_preparers(register: RegisterBatchPreparer) -> None:
    """Register batch preparers (the `rl.batch_preparer` names)."""


@hookspec
def plait_register_metric_sinks(register: RegisterMetricSink) -> None:
    """Register metric sinks (the `metrics.sinks` names)."""


@hookspec
def plait_register_models(register: RegisterModel) -> None:
    """Register model names that `model.name` resolves (see `plait.models.ModelSource`)."""


@hookspec
def plait_register_commands(cli: click.Group) -> None:
    """Add sub-commands to the `plait` CLI (a click group)."""
