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
             description="weights (full, bucketed or delta) handed to engines in this process")
    register("disk", "plait.sync:DiskSync", options="plait.sync:DiskSyncOptions",
             description="weights (full, bucketed or delta patches) written once as safetensors; engines load them from disk")
    register("distributed", "plait.distributed_sync:DistributedSync",
             options="plait.distributed_sync:DistributedSyncOptions",
             description="weights over a torch.distributed group (gloo/NCCL) to WeightReceiver processes")


@hookimpl
def plait_register_renderers(register: Any) -> None:
    register("chat_template", "plait.renderers.chat_template:ChatTemplateRenderer.from_model",
             options="plait.renderers.chat_template:ChatTemplateOptions",
             description="any Hugging Face chat template (needs transformers)")
