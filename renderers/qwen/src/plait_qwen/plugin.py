"""plait-qwen's plugin: the Qwen renderers, registered lazily (discovery imports no tokenizer)."""

from __future__ import annotations

from plait.api import RegisterRenderer, hookimpl

RENDERERS = {
    "qwen3": (
        "Qwen3 as its official chat template renders it (history reasoning stripped; no extension "
        "property)"
    ),
    "qwen3_keep_reasoning": (
        "Qwen3 keeping every turn as sampled (extension property: one datum per episode)"
    ),
    "qwen3_instruct_2507": "Qwen3-Instruct-2507 (no thinking; extension property)",
    "qwen3_5": (
        "Qwen3.5 as its official chat template renders it (XML tool calls; history reasoning "
        "stripped)"
    ),
    "qwen3_5_keep_reasoning": (
        "Qwen3.5 keeping every turn's reasoning (XML tool calls; extension property)"
    ),
}


@hookimpl
def plait_register_renderers(register: RegisterRenderer) -> None:
    for name, description in RENDERERS.items():
        register(
            name,
            f"plait_qwen.factories:{name}",
            options="plait_qwen.chatml:QwenOptions",
            description=description,
        )
