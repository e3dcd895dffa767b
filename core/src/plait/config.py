"""Run configs: TOML files checked against attrs classes.

Every error names the dotted path of the offending key: an unknown key lists the allowed ones (and
suggests the closest), a value of the wrong type says what was expected. Components' own options
(`trainer.options`, `env.options`, ...) are checked against the options class their plugin
registered, with the same messages.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from plait.errors import ConfigError
from plait.schema import non_negative, positive, structure
from plait.types import AdamParams


@attrs.frozen
class RunSection:
    name: str = "run"
    out_dir: str = "runs"
    seed: int = 0
    log_level: Literal["debug", "info", "warning", "error"] = "info"


@attrs.frozen
class ModelSection:
    name: str = "smollm2-135m-instruct"
    """A registered model name (`plait models`) or a path to a Hugging Face checkpoint directory."""
    tokenizer: str | None = None
    """A tokenizer directory, when it is not the model's own."""
    dtype: Literal["float32", "bfloat16"] = "float32"


ADAM_DEFAULTS = AdamParams()
"""`[trainer]`'s beta1, beta2, eps and weight_decay defaults: one definition, AdamParams'."""


@attrs.frozen
class TrainerSection:
    engine: str = "torch"
    learning_rate: float = attrs.field(default=1e-5, validator=positive)
    beta1: float = ADAM_DEFAULTS.beta1
    beta2: float = ADAM_DEFAULTS.beta2
    eps: float = ADAM_DEFAULTS.eps
    weight_decay: float = attrs.field(default=ADAM_DEFAULTS.weight_decay, validator=non_negative)
    grad_clip_norm: float = attrs.field(default=1.0, validator=non_negative)
    options: dict[str, Any] = attrs.field(factory=dict)

    @property
    def adam(self) -> AdamParams:
        """The optimizer settings of this table, as a training step passes them."""
        return AdamParams(**{f.name: getattr(self, f.name) for f in attrs.fields(AdamParams)})


@attrs.frozen
class InferenceSection:
    engine: str = "torch"
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class RendererSection:
    name: str = "chat_template"
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class SyncSection:
    method: str = "in_process"
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class EnvSection:
    name: str = "math.arith"
    train_split: str = "train"
    eval_split: str = "test"
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class KLSection:
    """A KL penalty to the reference policy, the initial weights, estimated per token as
    `estimator` says (Schulman's k1, k2, k3), reported as policy/kl_ref."""

    coef: float = attrs.field(default=0.0, validator=non_negative)
    """0: off."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    where: Literal["loss", "reward"] = "loss"
    """loss: coef x the mean estimate over the trained tokens joins the loss (GRPO's, TRL's
    beta). reward: coef x its sum over a sample's action tokens is taken off the sample's reward
    before the advantages (verl's use_kl_in_reward)."""
    reference: Literal["trainer", "inference"] = "trainer"
    """trainer: the policy's trainer keeps the initial weights and scores them in the training step
    (plait-torch's trainer.options.reference = true; with LoRA, its adapters off). inference: a
    frozen inference engine of the policy's model (its [inference] table, never synced) scores each
    episode as it ends, beside the sampling of the rest of the batch (not with an engine attached
    by url to a server: the policy's own, which weight sync updates)."""

    @property
    def on_engine(self) -> bool:
        """Whether a frozen inference engine scores the reference (the penalty on, `inference`)."""
        return bool(self.coef) and self.reference == "inference"

    def penalty_keys(self) -> dict[str, float]:
        """The trainer's loss_fn_config keys of this penalty (the estimator as its number: every
        wire carries one)."""
        return {"kl_coef": self.coef, "kl_estimator": float(self.estimator[1])}


@attrs.frozen
class RLSection:
    steps: int = attrs.field(default=20, validator=positive)
    schedule: Literal["sync", "async"] = "sync"
    """sync: sample, then train, then sync weights, in turn. async: sampling runs on while the
    trainer trains, within `off_policy.max_staleness`; weights are updated in flight."""
    groups_per_batch: int = attrs.field(default=8, validator=positive)
    """Prompts per step."""
    group_size: int = attrs.field(default=8, validator=positive)
    """Samples per prompt (the GRPO group)."""
    loss: str = "importance_sampling"
    loss_config: dict[str, float] = attrs.field(factory=dict)
    kl: KLSection = attrs.field(factory=KLSection)
    advantage: str = "grpo"
    """A registered advantage estimator (`plait plugins`); plait-algorithms': grpo, dr_grpo,
    rloo, reinforce++, reinforce++_baseline, gae."""
    advantage_options: dict[str, Any] = attrs.field(factory=dict)
    """The estimator's options (e.g. gae's `gamma`, `lam`), checked against its options class."""
    batch_preparer: str = "standard"
    """A registered batch preparer, which makes the datums of the groups (plait-algorithms')."""
    remove_constant_reward_groups: bool = True
    loss_aggregation: Literal["token_mean", "sequence_mean", "sequence_sum"] = "token_mean"
    """How each trained token's loss is weighed (the advantages carry it: losses are token sums).
    token_mean: 1 / the batch's action tokens (DAPO); sequence_mean: 1 / (its sample's action
    tokens x the batch's samples) (GRPO's and GSPO's); sequence_sum: 1 / the batch's samples."""
    overlong: Literal["keep", "mask", "penalty"] = "keep"
    """Samples a length limit cut (a response stopped at max_tokens or at what max_episode_tokens
    left). mask: not trained on, though their rewards still count in their group's advantages
    (TRL's mask_truncated_completions); penalty: DAPO's soft overlong punishment is added to every
    reward first: 0 up to max_tokens - overlong_buffer tokens (the episode's longest response),
    falling linearly to -1 at max_tokens, -1 for a cut one."""
    overlong_buffer: int = attrs.field(default=0, validator=non_negative)
    """penalty: the tokens below max_tokens over which the penalty grows (1 .. max_tokens)."""
    dynamic_sampling: bool = False
    """DAPO (sync schedule): groups whose rewards are all equal are left out and made up for by
    groups of the next prompts, until groups_per_batch groups are left or max_sampling_rounds."""
    max_sampling_rounds: int = attrs.field(default=3, validator=positive)
    """dynamic_sampling: rounds of sampling a step may take, the first included."""
    max_tokens: int = attrs.field(default=64, validator=positive)
    temperature: float = attrs.field(default=1.0, validator=non_negative)
    top_p: float = 1.0
    top_k: int = -1
    max_turns: int = attrs.field(default=1, validator=positive)
    """Model calls per episode (tool calls in between); more are cut and marked truncated."""
    max_episode_tokens: int | None = attrs.field(default=None, validator=positive)
    """Context budget of an episode: prompt plus every response and observation."""
    reward_reduce: Literal["sum", "last", "max", "mean"] = "sum"
    """How the rewards of an episode's tool calls become its reward."""
    env_timeout_s: float = attrs.field(default=300.0, validator=positive)
    """Longest an environment call may take; past it the episode fails (and only it)."""
    max_failed_fraction: float = attrs.field(
        default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)]
    )
    """A step whose episodes fail (their environment's fault) beyond this fraction, or all of
    them, stops the run: a broken environment must not pass for a task the model cannot do."""
    micro_batch_size: int = attrs.field(default=256, validator=positive)
    """Datums per forward_backward call. The trainer bounds activation memory itself (plait-torch:
    trainer.options.micro_batch_tokens); prefixes are shared only within a call."""

    @property
    def train_loss_config(self) -> dict[str, float]:
        """What training steps pass the loss: loss_config, with `kl`'s penalty when it acts in
        the loss."""
        in_loss = self.kl.coef and self.kl.where == "loss"
        return {**self.loss_config, **(self.kl.penalty_keys() if in_loss else {})}

    def __attrs_post_init__(self) -> None:
        if self.kl.coef and {"kl_coef", "kl_estimator"} & set(self.loss_config):
            raise ValueError("kl and loss_config's kl_coef / kl_estimator both set a KL penalty")
        if self.overlong == "penalty" and not 0 < self.overlong_buffer <= self.max_tokens:
            raise ValueError(
                f"overlong_buffer must be in [1, max_tokens = {self.max_tokens}] with "
                f"overlong = 'penalty', got {self.overlong_buffer}"
            )
        if self.dynamic_sampling and self.schedule == "async":
            raise ValueError(
                "dynamic_sampling needs schedule = 'sync' (async samples its batches ahead); "
                "under async, remove_constant_reward_groups leaves such groups out instead"
            )


def _at_least_one(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    if value != 0 and value < 1:
        raise ValueError(f"{attribute.name} must be 0 (off) or >= 1, got {value}")


def _at_most_one(_inst: Any, attribute: attrs.Attribute, value: float) -> None:
    if not 0 <= value <= 1:
        raise ValueError(f"{attribute.name} must be 0 (off) or in (0, 1], got {value}")


@attrs.frozen
class OffPolicySection:
    """How far behind the policy training data may be, and how it is corrected for that: by
    importance weights pi_train / pi_rollout, truncated and masked (`plait_algorithms.off_policy`
    has the formulas; pi_train costs one extra forward pass per step)."""

    max_staleness: int = attrs.field(default=1, validator=non_negative)
    """async: the most weight versions a sampled token may lag the policy that trains on it
    (0 = every batch is sampled by the weights it trains)."""
    update_pause: Literal["keep", "abort", "wait"] = "keep"
    """async: how engines pause for an in-flight weight update. keep: running sequences continue
    with the new weights (each token tagged with its version); abort: they stop and are continued
    by a new request under the new weights; wait: they finish under the old weights first."""
    update_timeout_s: float = attrs.field(default=600.0, validator=positive)
    """async: the longest wait for an engine to pause or resume around a weight update."""
    correction: str = "none"
    """none: the loss sees the sampler's logprobs as they are; else a registered correction
    (plait-algorithms': token / sequence, a weight per token or per sequence)."""
    truncate: float = attrs.field(default=2.0, validator=_at_least_one)
    """Importance weights above this are cut to it (truncated IS); 0 = no truncation."""
    mask_below: float = attrs.field(default=0.0, validator=_at_most_one)
    """Tokens (or sequences) with a weight below this are not trained on; 0 = off."""
    mask_above: float = attrs.field(default=0.0, validator=_at_least_one)
    """Tokens (or sequences) with a weight above this are not trained on; 0 = off."""

    def __attrs_post_init__(self) -> None:
        if self.mask_above and self.truncate and self.mask_above <= self.truncate:
            raise ValueError(
                f"mask_above ({self.mask_above}) must exceed truncate ({self.truncate}), "
                "or nothing is ever truncated"
            )


@attrs.frozen
class EvalSection:
    every: int = attrs.field(default=5, validator=non_negative)
    """Evaluate on held-out tasks every N steps (0 = only before and after training)."""
    tasks: int = attrs.field(default=64, validator=positive)
    samples_per_task: int = attrs.field(default=4, validator=positive)
    """k of pass@k; the first sample of each task is greedy and gives accuracy (pass@1)."""
    temperature: float = attrs.field(default=1.0, validator=non_negative)


@attrs.frozen
class CheckpointSection:
    every: int = attrs.field(default=0, validator=non_negative)
    """Save trainer state every N steps (0 = only at the end)."""
    keep: int = attrs.field(default=2, validator=positive)


@attrs.frozen
class MetricsSection:
    sinks: list[str] = attrs.field(factory=lambda: ["jsonl", "console"])
    """Metric sinks by name: `jsonl` is the core's; `console`, `tensorboard` and `dashboard` are
    plait-sinks'."""
    options: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    """Per-sink options, keyed by sink name."""


POLICY_TABLES = ("model", "trainer", "inference", "renderer", "sync")
"""The tables a `[policies.NAME]` section takes; each starts from the top-level table of that
name."""


@attrs.frozen
class PolicySection:
    """One policy of a run with several: its own model, trainer, inference, renderer and weight
    sync, playing the environment's roles it lists (`plait.rollout.ROLE_KEY`)."""

    roles: list[str] = attrs.field(factory=list)
    """The roles this policy plays; the first policy also plays every role no policy lists."""
    model: ModelSection = attrs.field(factory=ModelSection)
    trainer: TrainerSection = attrs.field(factory=TrainerSection)
    inference: InferenceSection = attrs.field(factory=InferenceSection)
    renderer: RendererSection = attrs.field(factory=RendererSection)
    sync: SyncSection = attrs.field(factory=SyncSection)


@attrs.frozen
class CriticSection:
    """PPO's value model (`[critic]`): a trainer of its own, built as a policy's trainer is (in
    this process, as a service or on Ray), on a copy of the policy's model or a smaller one with
    its tokenizer, with a value head (plait-torch: trainer.options.value_head = true). Its model
    and trainer tables start from the top-level ones; each step the batch preparer asks it for
    the values of the batch's tokens (rl.advantage = "gae") and fits it to their returns."""

    model: ModelSection = attrs.field(factory=ModelSection)
    trainer: TrainerSection = attrs.field(factory=TrainerSection)
    loss: str = "value"
    loss_config: dict[str, float] = attrs.field(factory=dict)
    updates: int = attrs.field(default=1, validator=positive)
    """Training steps on each batch (verl's critic ppo_epochs); value_clip binds from the 2nd."""


@attrs.frozen
class RunConfig:
    run: RunSection = attrs.field(factory=RunSection)
    model: ModelSection = attrs.field(factory=ModelSection)
    trainer: TrainerSection = attrs.field(factory=TrainerSection)
    inference: InferenceSection = attrs.field(factory=InferenceSection)
    renderer: RendererSection = attrs.field(factory=RendererSection)
    sync: SyncSection = attrs.field(factory=SyncSection)
    env: EnvSection = attrs.field(factory=EnvSection)
    rl: RLSection = attrs.field(factory=RLSection)
    off_policy: OffPolicySection = attrs.field(factory=OffPolicySection)
    eval: EvalSection = attrs.field(factory=EvalSection)
    checkpoint: CheckpointSection = attrs.field(factory=CheckpointSection)
    metrics: MetricsSection = attrs.field(factory=MetricsSection)
    policies: dict[str, PolicySection] = attrs.field(factory=dict)
    """Several policies in one run (`[policies.NAME]`); none: one policy from the top-level
    tables."""
    critic: CriticSection | None = None
    serve: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    """Options of the `plait serve` commands by name (`[serve.online]`), checked by the command."""

    def policy_sections(self) -> dict[str, PolicySection]:
        """Every policy of the run by name; a run without `[policies]` has one, "policy"."""
        return self.policies or {
            "policy": PolicySection(
                [], self.model, self.trainer, self.inference, self.renderer, self.sync
            )
        }


def parse_override(override: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (["a", "b"], value), the value parsed as TOML (bare words as strings)."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError("", f"override {override!r} is not of the form key.path=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for override in overrides:
        keys, value = parse_override(override)
        table = data
        for key in keys[:-1]:
            table = table.setdefault(key, {})
            if not isinstance(table, dict):
                raise ConfigError(".".join(keys), f"{key!r} is not a table")
        table[keys[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read a TOML run config (or the defaults), apply `key=value` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                "",
                f"no config file at {path}",
                fix="pass the path of a .toml run config, e.g. examples/arith_smollm2.toml",
            )
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("", f"{path} is not valid TOML: {exc}") from exc
    return structure(RunConfig, with_policy_defaults(apply_overrides(data, overrides)))


def with_policy_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """Each `[policies.NAME]` table of POLICY_TABLES, and `[critic]`'s model and trainer, as the
    top-level one with its own keys over it."""

    def merged(policy: Any, names: Sequence[str] = POLICY_TABLES) -> Any:
        if not isinstance(policy, dict):
            return policy  # structure() names the key and what it expected
        tables = {
            t: {**data[t], **policy.get(t, {})}
            for t in names
            if isinstance(data.get(t), dict) and isinstance(policy.get(t, {}), dict)
        }
        return {**policy, **tables}

    policies = data.get("policies")
    if isinstance(policies, dict):
        data = {**data, "policies": {name: merged(p) for name, p in policies.items()}}
    if "critic" in data:
        data = {**data, "critic": merged(data["critic"], ("model", "trainer"))}
    return data
