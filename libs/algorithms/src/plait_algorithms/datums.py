"""Trajectories as training data, token in, token out.

Turns are merged into one datum while each turn's prompt extends the previous turn's
prompt + completion token for token; where that breaks, a new datum begins, never a silent merge
(the renderer's bridge keeps a conversation's history token-exact: `plait.rollout`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from plait.api import DataError, Datum, ModelInput, TensorData, TrainerEngine, Trajectory, Turn

Samples = Sequence[Sequence[Sequence[Datum]]]
"""Per group and sample, the sample's datums."""
REF_LOGPROBS = "ref_logprobs"
"""The loss input of the reference policy's logprob of each target token (0 off the sampled)."""


@attrs.define
class TokenSegments:
    """A merged token sequence with, per token, the sampler logprob and whether it was sampled."""

    tokens: list[int]
    logprobs: list[float]
    sampled: list[bool]
    versions: list[int]
    routing: TensorData | None = None
    """The experts that routed every token but the last (MoE samplers asked for them)."""
    ref_logprobs: list[float] | None = None
    """The reference policy's logprob of every token (0 off the sampled ones), where every turn
    carries them (`rl.kl.reference = "inference"`); else None."""


def merge_turns(turns: Sequence[Turn]) -> list[TokenSegments]:
    """Group consecutive turns whose prompts extend the previous sequence; one segment per group."""
    segments: list[TokenSegments] = []
    current: TokenSegments | None = None
    for turn in turns:
        prompt = list(turn.prompt)
        if current is not None and prompt[: len(current.tokens)] == current.tokens:
            tail = prompt[len(current.tokens) :]
        else:
            if current is not None:
                segments.append(current)
            current = TokenSegments([], [], [], [], ref_logprobs=[])
            tail = prompt
        current.tokens.extend(tail)
        current.logprobs.extend([0.0] * len(tail))
        current.sampled.extend([False] * len(tail))
        current.versions.extend([-1] * len(tail))
        completion = turn.completion
        current.tokens.extend(completion.tokens)
        current.logprobs.extend(completion.logprobs)
        current.sampled.extend([True] * len(completion.tokens))
        current.versions.extend(completion.versions())
        current.ref_logprobs = _extended_refs(current.ref_logprobs, len(tail), turn)
        # A turn's routing covers its whole prompt (the engine ran it), so the last turn's wins.
        routing = completion.routed_experts
        current.routing = (
            routing if routing is not None and len(routing) == len(current.tokens) - 1 else None
        )
    if current is not None:
        segments.append(current)
    return segments


def _extended_refs(refs: list[float] | None, prompt_tokens: int, turn: Turn) -> list[float] | None:
    """A segment's reference logprobs with `turn` appended after `prompt_tokens` new prompt
    tokens; None once a turn has none."""
    if refs is None or turn.ref_logprobs is None:
        return None
    if len(turn.ref_logprobs) != len(turn.completion.tokens):
        raise DataError(
            f"a turn carries {len(turn.ref_logprobs)} reference logprobs for its "
            f"{len(turn.completion.tokens)} completion tokens",
            fix="the reference engine's compute_logprobs must give one logprob per prompt token",
        )
    return [*refs, *[0.0] * prompt_tokens, *turn.ref_logprobs]


def segment_to_datum(segment: TokenSegments, advantage: float | Sequence[float]) -> Datum:
    """Next-token-aligned datum: input = tokens[:-1], targets = tokens[1:].

    Loss inputs: target_tokens, logprobs (the sampler's, 0 on prompt positions), advantages (on
    sampled positions only), mask (1 on sampled positions) and, when sampled, routed_experts and
    ref_logprobs (the reference policy's, 0 on prompt positions).
    """
    tokens = np.asarray(segment.tokens, dtype=np.int64)
    sampled = np.asarray(segment.sampled[1:], dtype=np.float32)
    advantages = np.asarray(advantage, dtype=np.float32)
    advantages = (
        np.full(len(tokens) - 1, float(advantages), np.float32)
        if advantages.ndim == 0
        else advantages[1:]
    )
    inputs: dict[str, Any] = {
        "target_tokens": tokens[1:],
        "logprobs": np.asarray(segment.logprobs[1:], dtype=np.float32) * sampled,
        "advantages": advantages * sampled,
        "mask": sampled,
    }
    if segment.routing is not None:
        inputs["routed_experts"] = segment.routing
    if segment.ref_logprobs is not None:
        inputs[REF_LOGPROBS] = np.asarray(segment.ref_logprobs[1:], dtype=np.float32) * sampled
    return Datum(model_input=ModelInput.from_ints(tokens[:-1].tolist()), loss_fn_inputs=inputs)


def trajectory_to_datums(trajectory: Trajectory, advantage: float) -> list[Datum]:
    """Training data of one trajectory with one advantage for all its sampled tokens."""
    if trajectory.error is not None:
        return []
    return [
        segment_to_datum(seg, advantage)
        for seg in merge_turns(trajectory.turns)
        if len(seg.tokens) > 1
    ]


def action_mask(datum: Datum) -> np.ndarray:
    """Where the datum's targets are action (sampled) tokens."""
    return np.asarray(datum.loss_fn_inputs["mask"].to_numpy() > 0)


def action_tokens(datums: Sequence[Datum]) -> int:
    """How many action tokens a sample's datums hold."""
    return sum(int(action_mask(d).sum()) for d in datums)


def on_action_tokens(datums: Sequence[Datum], values: np.ndarray) -> list[np.ndarray]:
    """A sample's `values`, one per action token across its datums in order, placed on each
    datum's action tokens (float32, 0 elsewhere)."""
    out, start = [], 0
    for datum in datums:
        mask = action_mask(datum)
        placed = np.zeros(mask.shape, np.float32)
        end = start + int(mask.sum())
        placed[mask] = values[start:end]
        out.append(placed)
        start = end
    return out


def forward_outputs(
    trainer: TrainerEngine,
    data: Sequence[Datum],
    output: str,
    loss: str,
    loss_config: dict[str, float],
    micro_batch_size: int,
    missing: tuple[str, str],
) -> list[np.ndarray]:
    """The trainer's forward `output` of each datum, every position (`micro_batch_size` datums a
    call). A forward without `output` is a DataError: `missing` is (what needs it, the fix)."""
    outputs: list[np.ndarray] = []
    for start in range(0, len(data), micro_batch_size):
        out = trainer.forward(data[start : start + micro_batch_size], loss, loss_config)
        for given in out.loss_fn_outputs:
            if output not in given:
                raise DataError(
                    f"{missing[0]} needs the trainer's {output!r} output, and its forward gives "
                    f"no {output!r} output (it gives {sorted(given)})",
                    fix=missing[1],
                )
            outputs.append(given[output].to_numpy())
    return outputs


def forward_on_action_tokens(
    trainer: TrainerEngine,
    samples: Samples,
    output: str,
    loss: str,
    loss_config: dict[str, float],
    micro_batch_size: int,
    missing: tuple[str, str],
) -> list[list[np.ndarray]]:
    """Per group and sample, the trainer's forward `output` at each of its action tokens, in
    order (one forward pass over the samples' datums, `forward_outputs`)."""
    flat = [datum for group in samples for sample in group for datum in sample]
    return on_samples_action_tokens(
        samples,
        forward_outputs(trainer, flat, output, loss, loss_config, micro_batch_size, missing),
    )


def on_samples_action_tokens(
    samples: Samples, per_datum: Sequence[np.ndarray]
) -> list[list[np.ndarray]]:
    """Per group and sample, the values of `per_datum` (one array per datum of `samples` in
    order, every position) at the sample's action tokens, in order (float64)."""
    values = iter(per_datum)
    return [
        [
            np.concatenate([next(values)[action_mask(d)] for d in sample]).astype(np.float64)
            for sample in group
        ]
        for group in samples
    ]
