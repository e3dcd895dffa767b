"""The metrics of a step, built in one place (their names are read by dashboards and tests)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs
import numpy as np

from plait.metrics import mean, pass_at_k
from plait.protocols import MeasuresFlops, TrainerEngine
from plait.trajectory import Trajectory

_TRAINER_METRICS = {
    "entropy:mean": "policy/entropy",
    "importance_weight:max": "policy/importance_weight_max",
    "importance_weight:mean": "policy/importance_weight_mean",
    "mismatch_kl_k1:mean": "policy/mismatch_kl",
    "mismatch_kl_k2:mean": "policy/mismatch_kl_k2",
    "clip_fraction:mean": "optim/clip_fraction",
    "kl_ref:mean": "policy/kl_ref",
    "kl_penalty:sum": "optim/kl_penalty",
    "routing_agreement:mean": "policy/routing_agreement",
    "routing_natural_agreement:mean": "policy/routing_natural_agreement",
    "routing_bytes_per_token:mean": "data/routing_bytes_per_token",
    "loss:sum": "optim/loss",
    "optim:grad_norm": "optim/grad_norm",
    "optim:lr": "optim/lr",
}
"""The trainer's "name:reduction" metrics and the names a step reports them under."""


def union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Wall time during which at least one interval was running."""
    total, current_end = 0.0, -math.inf
    for start, end in sorted(intervals):
        if start > current_end:
            total += end - start
            current_end = end
        elif end > current_end:
            total += end - current_end
            current_end = end
    return total


def rollout_metrics(
    groups: Sequence[Sequence[Trajectory]], prefix: str = "reward"
) -> dict[str, float]:
    """Reward, pass@1/pass@k and episode-shape metrics of a batch of groups."""
    trajectories = [t for g in groups for t in g]
    valid = [t for t in trajectories if t.error is None]
    metrics: dict[str, float] = {
        f"{prefix}/mean": mean([t.reward for t in valid]),
        f"{prefix}/pass@1": mean([float(t.correct) for t in valid]),
    }
    valid_groups = [[t for t in g if t.error is None] for g in groups]
    k = max((len(g) for g in groups), default=0)  # groups that lost samples to errors: left out
    if k > 1 and any(len(v) >= k for v in valid_groups):
        metrics[f"{prefix}/pass@k"] = mean(
            [pass_at_k(len(v), sum(t.correct for t in v), k) for v in valid_groups if len(v) >= k]
        )
        metrics[f"{prefix}/k"] = float(k)
    metrics["env/turns_per_episode"] = mean([t.num_turns for t in valid])
    metrics["env/errors"] = float(len(trajectories) - len(valid))
    metrics["engine/retries"] = float(sum(t.engine_retries for t in trajectories))
    metrics["env/tool_errors"] = float(sum(t.tool_errors for t in trajectories))
    metrics["env/parse_errors"] = float(sum(t.parse_errors for t in trajectories))
    metrics["env/bridged_turns"] = float(sum(t.bridged_turns for t in trajectories))
    metrics["env/truncated"] = mean([float(t.truncated) for t in valid])
    metrics["data/prompt_tokens"] = mean([t.prompt_tokens for t in valid])
    metrics["data/response_tokens"] = mean([t.completion_tokens for t in valid])
    for key in sorted({key for t in valid for key in t.metrics}):
        metrics[key] = mean([t.metrics[key] for t in valid if key in t.metrics])
    return metrics


@attrs.frozen
class StepTimes:
    """Seconds of one step's parts."""

    rollout: float
    """Wall time of sampling the batch (first start to last end)."""
    stall: float
    """How long the trainer waited for the batch."""
    train: float
    sync: float
    total: float


def policy_metrics(
    groups: Sequence[Sequence[Trajectory]],
    *,
    prepared: Mapping[str, float],
    trained: Mapping[str, float],
    trainer: TrainerEngine,
    trained_version: int,
    train_seconds: float,
) -> dict[str, float]:
    """What a step reports of one policy: rewards and episode shape, data, policy and optimizer,
    off-policy staleness and training throughput."""
    trajectories = [t for g in groups for t in g]
    metrics = rollout_metrics(groups)
    metrics.update(prepared)
    sampled_lp = [
        lp
        for t in trajectories
        if t.error is None
        for turn in t.turns
        for lp in turn.completion.logprobs
    ]
    metrics["policy/entropy_sampled"] = -mean(sampled_lp) if sampled_lp else 0.0
    metrics.update({name: trained[key] for key, name in _TRAINER_METRICS.items() if key in trained})
    metrics.setdefault("policy/entropy", metrics["policy/entropy_sampled"])
    tokens = trained.get("train_tokens:sum", 0.0)
    if train_seconds > 0 and tokens:
        metrics["perf/tokens_per_s/train"] = tokens / train_seconds
    if (
        isinstance(trainer, MeasuresFlops)
        and trainer.peak_flops_per_s
        and train_seconds > 0
        and "model_flops:sum" in trained
    ):
        metrics["perf/mfu"] = trained["model_flops:sum"] / train_seconds / trainer.peak_flops_per_s
        metrics["perf/peak_flops"] = float(trainer.peak_flops_per_s)
    staleness = np.asarray(
        [
            trained_version - v
            for t in trajectories
            for turn in t.turns
            for v in turn.completion.versions()
        ]
    )
    metrics["async/staleness_mean"] = float(staleness.mean()) if staleness.size else 0.0
    metrics["async/staleness_max"] = float(staleness.max()) if staleness.size else 0.0
    return metrics


def step_metrics(
    groups: Sequence[Sequence[Trajectory]],
    policies: Sequence[Mapping[str, float]],
    *,
    times: StepTimes,
    schedule: Mapping[str, float],
    samples_before: int,
    restored: int,
) -> dict[str, float]:
    """Everything a step reports: each policy's (`policy_metrics`, named for it when there are
    several, beside the whole episodes' rewards), environment time, timing, rollout throughput,
    progress and the schedule's own (`schedule`)."""
    trajectories = [t for g in groups for t in g]
    metrics = rollout_metrics(groups)
    for part in policies:
        metrics.update(part)
    for role in sorted({r for t in trajectories if t.error is None for r in t.role_rewards}):
        metrics[f"role/{role}/reward"] = mean(
            [
                t.role_rewards[role]
                for t in trajectories
                if t.error is None and role in t.role_rewards
            ]
        )
    generated = sum(t.completion_tokens for t in trajectories)
    metrics.update(
        {
            "time/verify": union_seconds([iv for t in trajectories for iv in t.env_seconds]),
            "time/rollout": times.rollout,
            "time/train": times.train,
            "time/sync": times.sync,
            "time/stall": times.stall,
            "time/total": times.total,
            "perf/tokens_per_s/rollout": generated / times.rollout if times.rollout else 0.0,
            "progress/samples": float(samples_before + len(trajectories)),
            "progress/restored": float(restored),
        }
    )
    metrics.update(schedule)
    return metrics
