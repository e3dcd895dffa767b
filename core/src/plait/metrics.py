"""Metric computations, the `MetricSink` protocol and the core's own sink, `jsonl` (plait-sinks
has `console`, `tensorboard` and `dashboard`).

Metric names are stable API (see the design's metrics reference): `reward/mean`, `reward/pass@1`,
`reward/pass@k`, `policy/entropy`, `policy/importance_weight_max`, `policy/mismatch_kl`,
`optim/grad_norm`, `perf/mfu`, `time/{rollout,verify,train,sync,stall,total}`, ...
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


def merge_metrics(parts: Sequence[tuple[Mapping[str, float], int]]) -> dict[str, float]:
    """Merge "name:reduction" metrics of several chunks; `mean` is weighted by each chunk's
    count."""
    merged: dict[str, float] = {}
    weights: dict[str, float] = {}
    for metrics, count in parts:
        for key, value in metrics.items():
            reduction = key.rsplit(":", 1)[-1]
            if key not in merged:
                merged[key] = value * count if reduction == "mean" else value
                weights[key] = count
            elif reduction == "sum":
                merged[key] += value
            elif reduction == "max":
                merged[key] = max(merged[key], value)
            elif reduction == "min":
                merged[key] = min(merged[key], value)
            elif reduction == "mean":
                merged[key] += value * count
                weights[key] += count
            else:  # reductions without a merge rule keep the last value
                merged[key] = value
    for key, total in weights.items():
        if key.endswith(":mean") and total:
            merged[key] /= total
    return merged


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


@runtime_checkable
class MetricSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ShowsProgress(Protocol):
    """Optional metric-sink capability: told, before each part of a step, how many steps are
    done and what the run does now ("eval", "rollout/train", "checkpoint"); a progress bar."""

    def phase(self, done: int, name: str) -> None: ...


class JsonlSink:
    """Appends one JSON object per step to `metrics.jsonl` in the run directory (always on)."""

    def __init__(self, run_dir: Path, *, options: Any = None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {
            "step": step,
            "wall_time": time.time(),
            **{k: _finite(v) for k, v in metrics.items()},
        }
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible instead of dropping them
    return value


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a torn line (a crash mid-write) is skipped."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
