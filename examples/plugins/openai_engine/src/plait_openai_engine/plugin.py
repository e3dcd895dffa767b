"""The plugin module (entry point `openai_engine`): lazy targets only, so discovery imports no
httpx."""

from plait.api import RegisterInferenceEngine, hookimpl


@hookimpl
def plait_register_inference_engines(register: RegisterInferenceEngine) -> None:
    register(
        "openai",
        "plait_openai_engine.engine:OpenAIEngine",
        options="plait_openai_engine.engine:OpenAIOptions",
        description="any OpenAI-compatible /v1/completions server, attached by URL "
        "(no weight updates)",
    )
