"""The progress bar of long work, on stderr, with log lines printed above it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from plait.logs import console


class StepProgress:
    """`with StepProgress(total=N) as p: p.phase("rollout"); ...; p.advance(metrics)`."""

    STATUS = (("reward/mean", "reward"), ("loss", "loss"))
    """(metric key, label) shown beside the bar, those present in the step's metrics."""

    def __init__(self, total: int, completed: int = 0, title: str = "train") -> None:
        self._progress = Progress(
            TextColumn("[bold]{task.fields[title]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[phase]}"),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            disable=not console.is_terminal,
        )
        self._task = self._progress.add_task(
            title, total=total, completed=completed, title=title, phase="", status=""
        )

    def __enter__(self) -> StepProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._progress.stop()

    def phase(self, name: str) -> None:
        self._progress.update(self._task, phase=name)

    def advance(self, metrics: Mapping[str, float]) -> None:
        status = ", ".join(
            f"{label} {metrics[key]:.3f}" for key, label in self.STATUS if key in metrics
        )
        self._progress.update(self._task, advance=1, phase="", status=status)
