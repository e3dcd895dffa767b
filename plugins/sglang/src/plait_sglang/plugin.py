"""plait-sglang's plugin module: what it registers, by lazy "module:attribute" targets only."""

from __future__ import annotations

from plait.api import RegisterInferenceEngine, hookimpl


@hookimpl
def plait_register_inference_engines(register: RegisterInferenceEngine) -> None:
    register(
        "sglang",
        "plait_sglang.engine:SGLangEngine",
        options="plait_sglang.options:SGLangOptions",
        description="an SGLang HTTP server (launched or attached by URL), token-in-token-out",
    )
