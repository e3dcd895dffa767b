"""The `dashboard` metric sink: renders RUN_DIR/dashboard.png from the run's metrics.jsonl."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs
import structlog

from plait.api import non_negative
from plait_sinks.plot import plot_run

log = structlog.get_logger("plait.dashboard")


@attrs.frozen
class DashboardOptions:
    every: int = attrs.field(default=0, validator=non_negative)
    """Also render every N steps (0 = only when the run ends)."""


class DashboardSink:
    """Reads what the `jsonl` sink wrote (the whole run, steps before a resume included)."""

    def __init__(self, run_dir: Path, *, options: DashboardOptions | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.options = options or DashboardOptions()
        self.logged = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.logged = True
        if self.options.every and step and step % self.options.every == 0:
            self._render()

    def close(self) -> None:
        if self.logged:
            path = self._render()
            if path is not None:
                log.info("dashboard written", path=str(path))

    def _render(self) -> Path | None:
        if not (self.run_dir / "metrics.jsonl").is_file():
            log.warning(
                "the dashboard sink draws from metrics.jsonl, which this run does not write",
                fix="add 'jsonl' to metrics.sinks (before 'dashboard')",
            )
            return None
        return plot_run(self.run_dir)
