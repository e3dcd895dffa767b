"""The core's own plugin: registered through the same hooks as every third-party plugin."""

from __future__ import annotations

from typing import Any

from plait.hookspecs import hookimpl

_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")


@hookimpl
def plait_register_losses(register: Any) -> None:
    for name in _LOSSES:
        register(name, f"plait.losses:{name}", description=f"Tinker-compatible {name} loss (token sum)")


@hookimpl
def plait_register_metric_sinks(register: Any) -> None:
    register("jsonl", "plait.metrics:JsonlSink", description="metrics.jsonl in the run directory")
    register("console", "plait.metrics:ConsoleSink", options="plait.metrics:ConsoleOptions",
             description="one-line summary per step")
    register("tensorboard", "plait.metrics:TensorBoardSink", description="TensorBoard event files")


@hookimpl
def plait_register_weight_syncs(register: Any) -> None:
    register("in_process", "plait.sync:InProcessSync", options="plait.sync:InProcessSyncOptions",
             description="full weights handed over in memory (trainer and engine in one process)")
    register("disk", "plait.sync:DiskSync", options="plait.sync:DiskSyncOptions",
             description="full weights written once as safetensors; engines load them from disk")


@hookimpl
def plait_register_renderers(register: Any) -> None:
    register("chat_template", "plait.renderers.chat_template:ChatTemplateRenderer.from_model",
             options="plait.renderers.chat_template:ChatTemplateOptions",
             description="any Hugging Face chat template (needs transformers)")
