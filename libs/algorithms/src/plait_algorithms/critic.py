"""PPO's critic in the `standard` batch preparer (a run's `[critic]`).

Each step, before the advantages: the critic's value of every action token of the batch (one
forward pass over the samples' datums). After them: `critic.updates` training steps of the critic
(one by default) towards each token's return, advantage + value (with `rl.advantage = "gae"`,
the lambda-return), each token weighed alike (a token mean over the batch); then the advantages
are whitened over the batch's action tokens (mean 0, standard deviation 1, as verl does with
GAE), so that the policy's steps have the size a group-normalised estimator's have. The values
the critic is fit from are the ones the advantages were computed from, so the value loss's
clipping (`critic.loss_config.value_clip`) is around them: it binds from the second update on.

Reported: `critic/explained_variance` (1 - Var(R - V) / Var(R), of the values before the step:
how much of the returns' variance the critic predicts) over every action token, and over each
sample's first and last action token alone (`..._first_token`: the value of the prompt, before any
of the answer; `..._last_token`: the value with all of the answer but its last token in view), which
tells a critic that judges answers from one that cannot (over every token, the positions where the
return cannot yet be known weigh the figure down); `critic/value_loss`, `critic/values_mean`,
`critic/returns_mean`, `critic/value_clip_fraction`, `critic/grad_norm`. The explained variances
are 0 on a batch whose samples all end with the same return (the same reward, at their last token).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plait.api import (
    ADVANTAGE,
    ConfigError,
    Critic,
    Datum,
    RLSection,
    RunConfig,
    get_registry,
    train,
)
from plait_algorithms.advantages import EPS, without_critic
from plait_algorithms.datums import Samples, forward_on_action_tokens, on_action_tokens


def action_values(critic: Critic, rl: RLSection, samples: Samples) -> list[list[np.ndarray]]:
    """Per group and sample, the critic's value at each of its action tokens, in order."""
    as_values = [[[_value_datum(d) for d in sample] for sample in group] for group in samples]
    config = critic.config
    return forward_on_action_tokens(
        critic.trainer,
        as_values,
        "values",
        config.loss,
        config.loss_config,
        rl.micro_batch_size,
        missing=(
            "the critic",
            "give it a value head (plait-torch: critic.trainer.options.value_head = true)",
        ),
    )


def check_critic_config(config: RunConfig) -> None:
    """At config load: a critic goes with an estimator built on its values, and such an
    estimator with a critic."""
    rl = config.rl
    uses = getattr(get_registry().get(ADVANTAGE, rl.advantage).load(), "uses_values", False)
    if config.critic is not None and not uses:
        raise ConfigError(
            "rl.advantage",
            f"the run has a critic, and {rl.advantage!r} does not use its values: the critic "
            "would be fit to advantages that are not returns",
            fix='set rl.advantage = "gae" (or an estimator marked with '
            "plait_algorithms.advantages.uses_values), or drop the [critic] table",
        )
    if config.critic is None and uses:
        raise without_critic(rl.advantage)


def check_critic(critic: Critic) -> None:
    """A critic that gives values (or the run stops)."""
    if not critic.trainer.capabilities.value_head:
        raise ConfigError(
            "critic.trainer.options",
            f"the critic's trainer engine ({critic.config.trainer.engine!r}) was built without "
            "a value head, so it gives logprobs, not values",
            fix="give the critic one (plait-torch: critic.trainer.options.value_head = true)",
        )


def fit_critic(
    critic: Critic,
    rl: RLSection,
    samples: Samples,
    values: Sequence[Sequence[np.ndarray]],
    advantages: Sequence[Sequence[np.ndarray]],
) -> dict[str, float]:
    """`critic.config.updates` training steps of the critic towards advantage + value on every
    action token of the batch; the metrics of the last."""
    returns = [
        [a + v for a, v in zip(ga, gv, strict=True)]
        for ga, gv in zip(advantages, values, strict=True)
    ]
    flat_returns = np.concatenate([r for group in returns for r in group])
    flat_values = np.concatenate([v for group in values for v in group])
    weight = 1.0 / max(flat_returns.size, 1)
    data = [
        datum
        for group, group_returns, group_values in zip(samples, returns, values, strict=True)
        for sample, r, v in zip(group, group_returns, group_values, strict=True)
        for datum in _placed(sample, r, v, weight)
    ]
    for _ in range(critic.config.updates):
        trained = train(
            critic.trainer,
            critic.config.trainer,
            critic.config.loss,
            critic.config.loss_config,
            data,
            rl.micro_batch_size,
        )
    # Samples that all end alike (every answer right, or none) leave nothing to explain; with
    # lam < 1 their returns still differ by the critic's own values (one run measured -437).
    outcomes = _at(-1, returns)
    varied = bool(outcomes.size and outcomes.max() > outcomes.min())
    metrics = {
        "critic/explained_variance": explained_variance(flat_returns, flat_values, varied),
        **{
            f"critic/explained_variance_{where}_token": explained_variance(
                _at(position, returns), _at(position, values), varied
            )
            for where, position in (("first", 0), ("last", -1))
        },
        "critic/value_loss": trained["loss:sum"],
        "critic/values_mean": float(flat_values.mean()),
        "critic/returns_mean": float(flat_returns.mean()),
    }
    for key, name in (
        ("value_clip_fraction:mean", "value_clip_fraction"),
        ("optim:grad_norm", "grad_norm"),
    ):
        if key in trained:
            metrics[f"critic/{name}"] = trained[key]
    return metrics


def whitened(advantages: Sequence[Sequence[np.ndarray]]) -> list[list[np.ndarray]]:
    """(A - mean) / (std + eps) with mean and std over every action token of the batch."""
    flat = np.concatenate([a for group in advantages for a in group])
    mean, std = flat.mean(), flat.std()
    return [[(a - mean) / (std + EPS) for a in group] for group in advantages]


def explained_variance(returns: np.ndarray, values: np.ndarray, varied: bool = True) -> float:
    """1 - Var(returns - values) / Var(returns); 0 where the returns do not vary (or are none),
    or the caller says the outcomes behind them do not (`varied`)."""
    spread = float(returns.var()) if returns.size and varied else 0.0
    return 1.0 - float((returns - values).var()) / spread if spread > 0 else 0.0


def _at(position: int, per_sample: Sequence[Sequence[np.ndarray]]) -> np.ndarray:
    """Each sample's value at its action token `position` (samples without any left out)."""
    return np.array([tokens[position] for group in per_sample for tokens in group if tokens.size])


def _value_datum(
    datum: Datum,
    returns: np.ndarray | None = None,
    values: np.ndarray | None = None,
    weight: float = 1.0,
) -> Datum:
    """`datum`'s tokens with the value loss's inputs (zeros where not given: the values pass,
    whose loss is not used)."""
    mask = datum.loss_fn_inputs["mask"].to_numpy().astype(np.float32)
    zeros = np.zeros_like(mask)
    inputs = {
        "target_tokens": datum.loss_fn_inputs["target_tokens"],
        "mask": mask,
        "returns": zeros if returns is None else returns,
        "values": zeros if values is None else values,
        "weights": mask * weight,
    }
    return Datum(datum.model_input, inputs)


def _placed(
    sample: Sequence[Datum], returns: np.ndarray, values: np.ndarray, weight: float
) -> list[Datum]:
    """A sample's datums with its per-action-token returns and values on their action tokens."""
    return [
        _value_datum(datum, placed_returns, placed_values, weight)
        for datum, placed_returns, placed_values in zip(
            sample, on_action_tokens(sample, returns), on_action_tokens(sample, values), strict=True
        )
    ]
