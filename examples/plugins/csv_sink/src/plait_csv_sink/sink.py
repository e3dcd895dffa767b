"""The "csv" metric sink: one row per step in `<run_dir>/metrics.csv`.

Columns are `step`, `wall_time`, then the metric names in the order they first appeared. A step
that brings a new metric widens the file: it is rewritten with the new header (earlier rows get an
empty cell there) into a temporary file that then replaces it, so a crash never leaves half a
file. A run that resumes in the same directory appends to the file it finds.
"""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Mapping
from pathlib import Path

import attrs


@attrs.frozen
class CsvOptions:
    filename: str = "metrics.csv"
    """The file's name inside the run directory."""
    prefixes: list[str] = attrs.field(factory=list)
    """Keep only metrics whose name starts with one of these (e.g. ["reward/", "time/"]); [] keeps
    all."""


class CsvSink:
    def __init__(self, run_dir: Path, *, options: CsvOptions | None = None) -> None:
        self.options = options or CsvOptions()
        self.path = Path(run_dir) / self.options.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = ["step", "wall_time"]
        if self.path.exists():  # a resumed run: carry on with the columns already there
            with self.path.open(newline="") as f:
                self.columns = next(csv.reader(f), []) or self.columns

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step, "wall_time": round(time.time(), 3)}
        row.update(
            (k, v)
            for k, v in metrics.items()
            if not self.options.prefixes or k.startswith(tuple(self.options.prefixes))
        )
        new = [k for k in row if k not in self.columns]
        if new or not self.path.exists():
            self._rewrite([*self.columns, *new])
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow(row)

    def _rewrite(self, columns: list[str]) -> None:
        rows = []
        if self.path.exists():
            with self.path.open(newline="") as f:
                rows = list(csv.DictReader(f))
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
        self.columns = columns

    def close(self) -> None:
        """Nothing to flush: every row is written when it is logged."""
