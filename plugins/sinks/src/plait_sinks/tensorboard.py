"""The `tensorboard` metric sink."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from plait.api import PlaitError


class TensorBoardSink:
    """Scalars to TensorBoard event files under `<run_dir>/tb` (with tensorboardX: no torch)."""

    def __init__(self, run_dir: Path, *, options: None = None) -> None:  # it takes no options
        try:
            from tensorboardX import SummaryWriter
        except ImportError as exc:
            raise PlaitError(
                f"the tensorboard metric sink needs tensorboardX: {exc}",
                fix="pip install 'plait-sinks[tensorboard]', "
                "or drop 'tensorboard' from metrics.sinks",
            ) from exc
        self.writer = SummaryWriter(str(Path(run_dir) / "tb"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()
