"""The `console` metric sink: one line per step, above a progress bar of the run's steps."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path

import attrs
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

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
    """A one-line summary per step on stderr and, on a terminal, a bar of the run's steps with
    the part of the step under way (the run tells it: `plait.api.ShowsProgress`)."""

    STATUS = (("reward/mean", "reward"), ("eval/accuracy", "eval"))
    """(metric key, label) shown beside the bar, those present in the step's metrics."""

    def __init__(self, run_dir: Path, *, options: ConsoleOptions | None = None) -> None:
        keys = (options or ConsoleOptions()).keys
        policies = policy_names(run_dir)  # each key also for each policy of a multi-policy run
        self.keys = [
            variant for key in keys for variant in (key, *(f"{key}@{p}" for p in policies))
        ]
        self.console = console
        config_file = Path(run_dir) / "config.toml"
        config = tomllib.loads(config_file.read_text()) if config_file.is_file() else {}
        self.title = config.get("run", {}).get("name", Path(run_dir).name)
        self.total = config.get("rl", {}).get("steps")
        self.progress: Progress | None = None
        self.task: TaskID | None = None
        self.latest: dict[str, float] = {}
        """The last value of each STATUS metric (evaluations come every few steps)."""
        self.status = ""

    def phase(self, done: int, name: str) -> None:
        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]{task.fields[title]}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[phase]}"),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                disable=not self.console.is_terminal,
            )
            self.progress.start()
            self.task = self.progress.add_task(
                self.title, total=self.total, title=self.title, phase="", status=""
            )
        assert self.task is not None
        self.progress.update(self.task, completed=done, phase=name, status=self.status)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        parts = [
            f"{key.split('/')[-1]}={_fmt(metrics[key])}" for key in self.keys if key in metrics
        ]
        self.console.print("  ".join([f"step {step:>4}", *parts]))
        self.latest.update({label: metrics[key] for key, label in self.STATUS if key in metrics})
        self.status = ", ".join(f"{label} {value:.3f}" for label, value in self.latest.items())
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, completed=step, phase="", status=self.status)

    def close(self) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.update(self.task, phase="", status=self.status)
            self.progress.stop()


def _fmt(value: float) -> str:
    if isinstance(value, int) or (
        isinstance(value, float) and value.is_integer() and abs(value) < 1e6
    ):
        return str(int(value))
    return f"{value:.4g}"
