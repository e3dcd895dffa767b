"""plait-hf's plugin module: the chat-template renderer, by a lazy target
(no transformers on import)."""

from __future__ import annotations

from plait.api import RegisterRenderer, hookimpl


@hookimpl
def plait_register_renderers(register: RegisterRenderer) -> None:
    register(
        "chat_template",
        "plait_hf.chat_template:ChatTemplateRenderer.from_model",
        options="plait_hf.chat_template:ChatTemplateOptions",
        description="any Hugging Face chat template (needs transformers)",
    )
