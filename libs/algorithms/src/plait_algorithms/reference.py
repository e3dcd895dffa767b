"""The KL reference on a frozen inference engine (`rl.kl.reference = "inference"`).

The run loop builds a second engine from each policy's `[inference]` table and never syncs it;
the `standard` batch preparer has it score each episode to train on as the episode ends (every
turn at once, on its policy's engine), so that the reference forward runs beside the sampling of
the rest of the batch; the datums then carry its logprobs (`plait_algorithms.datums`). A failing
reference engine stops the run, named as the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from plait.api import (
    ConfigError,
    DataError,
    Datum,
    EngineError,
    InferenceEngine,
    ModelInput,
    RunConfig,
    Trajectory,
    Turn,
    all_or_none,
)
from plait_algorithms.datums import REF_LOGPROBS


def check_reference(config: RunConfig) -> None:
    """At config load: no policy's reference would attach to the policy's own server."""
    if not config.rl.kl.on_engine:
        return
    for name, policy in config.policy_sections().items():
        if policy.inference.options.get("url"):
            at = f"policies.{name}." if config.policies else ""
            raise ConfigError(
                f"{at}inference.options.url",
                "rl.kl.reference = 'inference' builds the frozen reference engine from this "
                "table, and url attaches it to the policy's own server, which weight sync updates",
                fix="let the engine launch a server of its own (leave url out), or use "
                "rl.kl.reference = 'trainer'",
            )


async def with_reference(
    config: RunConfig, trajectory: Trajectory, references: Sequence[InferenceEngine | None]
) -> Trajectory:
    """`trajectory` with each turn's reference logprobs, scored by `references` (one engine per
    turn, all at once); as it is where the reference is not on an engine."""
    if not config.rl.kl.on_engine:
        return trajectory
    engines = [engine for engine in references if engine is not None]
    if len(engines) < len(trajectory.turns):
        raise ConfigError(
            "rl.kl.reference",
            "'inference', but a turn's policy has no reference engine",
            fix="build the policies with plait.api.build_components: with this setting it gives "
            "each a frozen engine",
        )
    turns = await all_or_none(
        [_scored(turn, engine) for turn, engine in zip(trajectory.turns, engines, strict=True)]
    )
    return attrs.evolve(trajectory, turns=turns)


async def _scored(turn: Turn, engine: InferenceEngine) -> Turn:
    sequence = ModelInput.from_ints([*turn.prompt, *turn.completion.tokens])
    try:
        logprobs = await engine.compute_logprobs(sequence)
    except Exception as exc:
        raise EngineError(
            f"the KL reference engine ({type(engine).__name__}, rl.kl.reference = 'inference') "
            f"failed: {type(exc).__name__}: {exc}",
            fix="see the reference engine's log; `plait run` resumes from the last checkpoint",
        ) from exc
    ref = tuple(lp for lp in logprobs[len(turn.prompt) :] if lp is not None)
    return attrs.evolve(turn, ref_logprobs=ref)


def check_reference_logprobs(samples: Sequence[Sequence[Sequence[Datum]]]) -> None:
    """Every datum carries the reference's logprobs."""
    if any(REF_LOGPROBS not in d.loss_fn_inputs for g in samples for s in g for d in s):
        raise DataError(
            "rl.kl.reference = 'inference', but episodes came without the reference's logprobs "
            "(the run loop's sampling adds them; online RL's episodes and trajectories built "
            "elsewhere have none)",
            fix="use rl.kl.reference = 'trainer' (plait-torch: trainer.options.reference = true), "
            "or give every turn its ref_logprobs",
        )
