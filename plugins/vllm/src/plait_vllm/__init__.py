"""plait's vLLM inference engine (see README.md). Importing this package imports no vLLM."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait_vllm.engine import VLLMEngine
    from plait_vllm.options import VLLMOptions

__all__ = ["VLLMEngine", "VLLMOptions"]


def __getattr__(name: str) -> type:  # lazy: plugin discovery imports only plait_vllm.plugin
    if name == "VLLMEngine":
        from plait_vllm.engine import VLLMEngine

        return VLLMEngine
    if name == "VLLMOptions":
        from plait_vllm.options import VLLMOptions

        return VLLMOptions
    raise AttributeError(name)
