"""The core's own plugin: registered through the same hooks as every third-party plugin."""

from __future__ import annotations

from plait.hookspecs import hookimpl
from plait.kinds import RegisterMetricSink


@hookimpl
def plait_register_metric_sinks(register: RegisterMetricSink) -> None:
    register("jsonl", "plait.metrics:JsonlSink", description="metrics.jsonl in the run directory")
