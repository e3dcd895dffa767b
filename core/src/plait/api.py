"""plait's public API: everything a plugin, a library or the SDK may import from the core.

The core's modules behind these names may be moved, split or renamed between releases; this
module's names stay. `make lint` keeps this repository's own distributions on it (an
import-linter contract), so a plugin that builds here builds against any core that keeps this
module. Every name is re-exported explicitly (`import X as X`), for type checkers that want it.
"""

from plait.components import (
    Components as Components,
    Policy as Policy,
    build_components as build_components,
    resolve_model as resolve_model,
)
from plait.config import (
    OffPolicySection as OffPolicySection,
    RLSection as RLSection,
    RunConfig as RunConfig,
    apply_overrides as apply_overrides,
    load_config as load_config,
)
from plait.errors import (
    ConfigError as ConfigError,
    DataError as DataError,
    EngineError as EngineError,
    EnvironmentError_ as EnvironmentError_,
    ModelError as ModelError,
    PlaitError as PlaitError,
    PluginError as PluginError,
    RendererError as RendererError,
    UnknownComponentError as UnknownComponentError,
    WeightSyncError as WeightSyncError,
)
from plait.hookspecs import hookimpl as hookimpl
from plait.kinds import (
    ADVANTAGE as ADVANTAGE,
    ENV as ENV,
    INFERENCE_ENGINE as INFERENCE_ENGINE,
    LOSS as LOSS,
    METRIC_SINK as METRIC_SINK,
    MODEL as MODEL,
    OFF_POLICY_CORRECTION as OFF_POLICY_CORRECTION,
    RENDERER as RENDERER,
    TRAINER_ENGINE as TRAINER_ENGINE,
    WEIGHT_SYNC as WEIGHT_SYNC,
    AdvantageBatch as AdvantageBatch,
    AdvantageEstimator as AdvantageEstimator,
    BatchPreparer as BatchPreparer,
    Critic as Critic,
    EnvFactory as EnvFactory,
    InferenceEngineFactory as InferenceEngineFactory,
    Kind as Kind,
    LossFunction as LossFunction,
    MetricSinkFactory as MetricSinkFactory,
    RegisterAdvantage as RegisterAdvantage,
    RegisterBatchPreparer as RegisterBatchPreparer,
    RegisterEnv as RegisterEnv,
    RegisterInferenceEngine as RegisterInferenceEngine,
    RegisterLoss as RegisterLoss,
    RegisterMetricSink as RegisterMetricSink,
    RegisterModel as RegisterModel,
    RegisterOffPolicyCorrection as RegisterOffPolicyCorrection,
    RegisterRenderer as RegisterRenderer,
    RegisterTrainerEngine as RegisterTrainerEngine,
    RegisterWeightSync as RegisterWeightSync,
    RendererFactory as RendererFactory,
    TrainerEngineFactory as TrainerEngineFactory,
    WeightSyncFactory as WeightSyncFactory,
)
from plait.logs import (
    configure_logging as configure_logging,
    console as console,
    ensure_configured as ensure_configured,
)
from plait.metrics import (
    MetricSink as MetricSink,
    ShowsProgress as ShowsProgress,
    merge_metrics as merge_metrics,
    pass_at_k as pass_at_k,
    read_jsonl as read_jsonl,
)
from plait.models import (
    ModelSource as ModelSource,
    ResolvedModel as ResolvedModel,
    load_materializer as load_materializer,
    materialized as materialized,
)
from plait.plugins import build as build, get_registry as get_registry
from plait.protocols import (
    AdapterEngine as AdapterEngine,
    AdapterTrainer as AdapterTrainer,
    ClosableWeightSync as ClosableWeightSync,
    Environment as Environment,
    EnvSession as EnvSession,
    InferenceEngine as InferenceEngine,
    MeasuresFlops as MeasuresFlops,
    Renderer as Renderer,
    Tokenizer as Tokenizer,
    TrainerEngine as TrainerEngine,
    WeightSync as WeightSync,
)
from plait.rollout import (
    REWARDS_KEY as REWARDS_KEY,
    ROLE_KEY as ROLE_KEY,
    DrivesEpisodes as DrivesEpisodes,
    EpisodeConfig as EpisodeConfig,
    is_correct as is_correct,
    reduce_rewards as reduce_rewards,
    run_episode as run_episode,
    sample_through_aborts as sample_through_aborts,
    terminal_argument as terminal_argument,
)

# The run loop's steps, for services that drive a loop of their own (plait-proxy's online
# learner): each takes what it uses (the config, the components, a policy).
from plait.run.checkpoint import fsync_dir as fsync_dir
from plait.run.loop import (
    close_components as close_components,
    log_metrics as log_metrics,
    prepare_run_dir as prepare_run_dir,
)
from plait.run.report import policy_metrics as policy_metrics
from plait.run.schedules import engines_paused as engines_paused
from plait.run.steps import (
    all_or_none as all_or_none,
    episode_config as episode_config,
    evaluate_held_out as evaluate_held_out,
    prepare_groups as prepare_groups,
    publish_policy as publish_policy,
    train as train,
    train_prepared as train_prepared,
)
from plait.schema import non_negative as non_negative, positive as positive, structure as structure
from plait.serde import from_json as from_json, to_json as to_json
from plait.targets import load_target as load_target
from plait.trajectory import (
    PromptSource as PromptSource,
    Trajectory as Trajectory,
    Turn as Turn,
)
from plait.types import (
    AdamParams as AdamParams,
    Block as Block,
    Datum as Datum,
    EngineHealth as EngineHealth,
    ForwardBackwardOutput as ForwardBackwardOutput,
    ImageBlock as ImageBlock,
    LoraConfig as LoraConfig,
    Message as Message,
    ModelInput as ModelInput,
    OptimStepResult as OptimStepResult,
    ParseTermination as ParseTermination,
    PauseMode as PauseMode,
    SampledSequence as SampledSequence,
    SampleResponse as SampleResponse,
    SamplingParams as SamplingParams,
    Split as Split,
    StopReason as StopReason,
    StopSpec as StopSpec,
    SyncStats as SyncStats,
    TensorData as TensorData,
    TextBlock as TextBlock,
    ToolCall as ToolCall,
    ToolError as ToolError,
    ToolErrorReason as ToolErrorReason,
    ToolOutput as ToolOutput,
    ToolSpec as ToolSpec,
    TrainerCapabilities as TrainerCapabilities,
    TrainOnWhat as TrainOnWhat,
    WeightUpdate as WeightUpdate,
    blocks_text as blocks_text,
    prompt_token_ids as prompt_token_ids,
)
