"""plait-megatron's plugin module: lazy "module:attribute" targets only, so discovery imports
neither torch nor megatron-core."""

from __future__ import annotations

from plait.api import RegisterTrainerEngine, hookimpl


@hookimpl
def plait_register_trainer_engines(register: RegisterTrainerEngine) -> None:
    register(
        "megatron",
        "plait_megatron.engine:MegatronTrainer",
        options="plait_megatron.options:MegatronOptions",
        description="megatron-core GPTModel trainer for Qwen3 "
        "(one process, TP = PP = 1; CPU or one CUDA device)",
    )
