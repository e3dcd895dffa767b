"""The kinds of component a plugin registers, in one table, with the type of each kind's factory.

A plugin's `plait_register_<kind>s(register)` hook calls `register(name, target, ...)`, where
`target` is the factory (or a lazy "module:attribute" string naming it) and the factory's type
is the kind's: a trainer-engine factory takes the model, its validated options and the run's
seed and returns a `TrainerEngine`, and so on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import attrs
import numpy as np

from plait.config import CriticSection, OffPolicySection, RLSection, RunConfig
from plait.metrics import MetricSink
from plait.models import ModelSource, ResolvedModel
from plait.protocols import Environment, InferenceEngine, Renderer, TrainerEngine, WeightSync
from plait.trajectory import Trajectory
from plait.types import Datum

F = TypeVar("F")
F_contra = TypeVar("F_contra", contravariant=True)


class TrainerEngineFactory(Protocol):
    def __call__(self, model: ResolvedModel, *, options: Any, seed: int) -> TrainerEngine: ...


class InferenceEngineFactory(Protocol):
    def __call__(self, model: ResolvedModel, *, options: Any, seed: int) -> InferenceEngine: ...


class WeightSyncFactory(Protocol):
    def __call__(self, *, options: Any) -> WeightSync: ...


class RendererFactory(Protocol):
    def __call__(self, model: ResolvedModel, *, options: Any) -> Renderer: ...


class EnvFactory(Protocol):
    def __call__(self, *, options: Any) -> Environment: ...


class MetricSinkFactory(Protocol):
    def __call__(self, run_dir: Path, *, options: Any) -> MetricSink: ...


LossFunction = Callable[..., Any]
"""`loss(data, logprobs, config) -> LossOutput` on the trainer's tensors (see
`plait_train.losses`)."""


@attrs.frozen(eq=False)  # arrays: == would not give one bool
class AdvantageBatch:
    """What an advantage estimator sees: a step's whole batch at once (REINFORCE++ normalises
    over it), by group (the samples of one prompt; online RL's batch is one group)."""

    rewards: list[np.ndarray]
    """Per group, each sample's reward (float64)."""
    action_tokens: list[np.ndarray]
    """Per group, each sample's number of action (sampled) tokens over all its turns."""
    values: list[list[np.ndarray]] | None = None
    """Per group and sample, a critic's value of each action token; None: the run has no critic."""


class AdvantageEstimator(Protocol):
    """`(batch, *, options) -> per group and sample, one advantage per action token` (in the
    order of the sample's turns); `options` is `rl.advantage_options` validated."""

    def __call__(self, batch: AdvantageBatch, *, options: Any) -> list[list[np.ndarray]]: ...


OffPolicyCorrection = Callable[
    [Sequence[Datum], Sequence[np.ndarray], OffPolicySection], tuple[list[Datum], dict[str, float]]
]
"""(datums, the trainer's logprobs of each, options) -> the corrected datums and metrics."""


@attrs.define
class Critic:
    """A run's value model (`[critic]`): its trainer's forward gives "values" per position."""

    config: CriticSection
    model: ResolvedModel
    trainer: TrainerEngine


class BatchPreparer(Protocol):
    """How a step's groups of trajectories (each the samples of one prompt) become one policy's
    training data: `check` refuses at config load a run it cannot prepare (errors name the key);
    `annotate` adds to each episode to train on, as it ends, what other engines must compute
    (with `rl.kl.reference = "inference"`, the logprobs of `references`, each turn's policy's
    frozen engine or None); `prepare` turns the groups into datums with advantages and `data/*`
    metrics, fitting the run's critic where it has one (`critic`, else None), taking the KL to the
    reference off the rewards where `rl.kl.where = "reward"`, and applying `off_policy.correction`
    with `trainer`, the policy's; `has_signal` says whether a group would train
    (`rl.dynamic_sampling` samples until enough do). plait-algorithms' is `standard`."""

    def check(self, config: RunConfig) -> None: ...

    async def annotate(
        self,
        config: RunConfig,
        trajectory: Trajectory,
        references: Sequence[InferenceEngine | None],
    ) -> Trajectory: ...

    def prepare(
        self,
        config: RunConfig,
        groups: Sequence[Sequence[Trajectory]],
        trainer: TrainerEngine,
        critic: Critic | None = None,
    ) -> tuple[list[Datum], dict[str, float]]: ...

    def has_signal(self, rl: RLSection, group: Sequence[Trajectory]) -> bool: ...


class Register(Protocol[F_contra]):
    """The callback a register hook receives.

    `options` is the attrs class (or a lazy "module:Class" string) that validates the component's
    `options` table in a run config; None means the component takes no options."""

    def __call__(
        self,
        name: str,
        target: F_contra | str,
        *,
        options: type | str | None = None,
        description: str = "",
    ) -> None: ...


@attrs.frozen
class Kind(Generic[F]):
    """One kind of component: the hook that registers it and the config key that selects one."""

    name: str
    hook: str
    config_key: str
    """Where a run config names a component of this kind (for error messages)."""

    @property
    def label(self) -> str:
        return self.name.replace("_", " ")


TRAINER_ENGINE: Kind[TrainerEngineFactory] = Kind(
    "trainer_engine", "plait_register_trainer_engines", "trainer.engine"
)
INFERENCE_ENGINE: Kind[InferenceEngineFactory] = Kind(
    "inference_engine", "plait_register_inference_engines", "inference.engine"
)
WEIGHT_SYNC: Kind[WeightSyncFactory] = Kind(
    "weight_sync", "plait_register_weight_syncs", "sync.method"
)
RENDERER: Kind[RendererFactory] = Kind("renderer", "plait_register_renderers", "renderer.name")
ENV: Kind[EnvFactory] = Kind("env", "plait_register_envs", "env.name")
LOSS: Kind[LossFunction] = Kind("loss", "plait_register_losses", "rl.loss")
ADVANTAGE: Kind[AdvantageEstimator] = Kind("advantage", "plait_register_advantages", "rl.advantage")
OFF_POLICY_CORRECTION: Kind[OffPolicyCorrection] = Kind(
    "off_policy_correction", "plait_register_off_policy_corrections", "off_policy.correction"
)
BATCH_PREPARER: Kind[BatchPreparer] = Kind(
    "batch_preparer", "plait_register_batch_preparers", "rl.batch_preparer"
)
METRIC_SINK: Kind[MetricSinkFactory] = Kind(
    "metric_sink", "plait_register_metric_sinks", "metrics.sinks"
)
MODEL: Kind[ModelSource] = Kind("model", "plait_register_models", "model.name")

KINDS: tuple[Kind[Any], ...] = (
    TRAINER_ENGINE,
    INFERENCE_ENGINE,
    WEIGHT_SYNC,
    RENDERER,
    ENV,
    LOSS,
    ADVANTAGE,
    OFF_POLICY_CORRECTION,
    BATCH_PREPARER,
    METRIC_SINK,
    MODEL,
)
KINDS_BY_NAME: dict[str, Kind[Any]] = {kind.name: kind for kind in KINDS}

RegisterTrainerEngine = Register[TrainerEngineFactory]
RegisterInferenceEngine = Register[InferenceEngineFactory]
RegisterWeightSync = Register[WeightSyncFactory]
RegisterRenderer = Register[RendererFactory]
RegisterEnv = Register[EnvFactory]
RegisterLoss = Register[LossFunction]
RegisterAdvantage = Register[AdvantageEstimator]
RegisterOffPolicyCorrection = Register[OffPolicyCorrection]
RegisterBatchPreparer = Register[BatchPreparer]
RegisterMetricSink = Register[MetricSinkFactory]
RegisterModel = Register[ModelSource]
