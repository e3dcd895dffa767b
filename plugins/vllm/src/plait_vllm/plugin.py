"""plait-vllm's plugin module: what it registers, by lazy "module:attribute" targets only."""

from __future__ import annotations

from plait.api import RegisterInferenceEngine, hookimpl


@hookimpl
def plait_register_inference_engines(register: RegisterInferenceEngine) -> None:
    register(
        "vllm",
        "plait_vllm.engine:VLLMEngine",
        options="plait_vllm.options:VLLMOptions",
        description="a vLLM HTTP server (launched or attached by URL), token-in-token-out",
    )
