"""The `console` metric sink: one line per step."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs

from plait.api import console
from plait_sinks.plot import policy_names


@attrs.frozen
class ConsoleOptions:
    keys: list[str] = attrs.field(
        factory=lambda: [
            "reward/mean",
            "eval/accuracy",
            "policy/entropy",
            "optim/grad_norm",
            "time/total",
        ]
    )
    """Metrics shown in the one-line summary of each step."""


class ConsoleSink:
    """A one-line summary per step on stderr (the progress bar is the controller's)."""

    def __init__(self, run_dir: Path, *, options: ConsoleOptions | None = None) -> None:
        keys = (options or ConsoleOptions()).keys
        policies = policy_names(run_dir)  # each key also for each policy of a multi-policy run
        self.keys = [
            variant for key in keys for variant in (key, *(f"{key}@{p}" for p in policies))
        ]
        self.console = console

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        parts = [
            f"{key.split('/')[-1]}={_fmt(metrics[key])}" for key in self.keys if key in metrics
        ]
        self.console.print("  ".join([f"step {step:>4}", *parts]))

    def close(self) -> None:
        pass


def _fmt(value: float) -> str:
    if isinstance(value, int) or (
        isinstance(value, float) and value.is_integer() and abs(value) < 1e6
    ):
        return str(int(value))
    return f"{value:.4g}"
