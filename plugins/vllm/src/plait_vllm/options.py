"""Options of the "vllm" inference engine (`inference.options` in a run config)."""

from __future__ import annotations

import attrs

from plait.api import positive
from plait_server.engine import ServerOptions

VENV_ENV = "PLAIT_VLLM_VENV"
"""Environment variable naming the venv whose python runs the server when `python` is not set."""


@attrs.frozen
class VLLMOptions(ServerOptions):
    """`url` attaches to a running server, which needs `VLLM_SERVER_DEV_MODE=1` (pause, weight
    loading) and `--enable-scale-out` (the token route); `python` defaults to
    $PLAIT_VLLM_VENV/bin/python, else this interpreter."""

    dtype: str | None = None
    """The server's --dtype; None follows model.dtype. Logprobs match a float32 trainer only in
    float32."""
    max_model_len: int = attrs.field(default=2048, validator=positive)
    kv_cache_gib: int = attrs.field(default=1, validator=positive)
    """KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float | None = None
    """On a GPU: vLLM's --gpu-memory-utilization (None keeps vLLM's default)."""
    enforce_eager: bool = True
    chunked_prefill: bool | None = None
    """vLLM's chunked prefill: a prompt that does not fit what is left of a step's token budget
    is prefilled in pieces. None = off when the server's vLLM is a CPU build, vLLM's default (on)
    otherwise. vLLM-CPU 0.32 dies on it: for a seeded request whose prefill was split it rewinds
    the request's generator (`set_offset`), which CPU generators do not have. Off, a prompt waits
    for a step with room for all of it (vLLM then sizes the budget to at least max_model_len)."""
    enable_lora: bool = False
    """Serve LoRA adapters (`load_lora_adapter`); needs max_lora_rank >= the adapters' rank."""
    max_lora_rank: int = attrs.field(default=16, validator=positive)
    max_loras: int = attrs.field(default=2, validator=positive)
    enable_return_routed_experts: bool = False
    """MoE models: return each token's routed experts (for routing replay)."""
    weight_transfer_backend: str | None = None
    """Enable vLLM's distributed weight-update API with this backend: "nccl" on GPUs, "gloo"
    (plait's worker extension provides it) on CPU. None = weights by disk only."""
    plait_worker_extension: bool | None = None
    """Whether the server runs plait's worker extension (`plait_vllm_worker.PlaitWorkerExtension`):
    a launched server always does; for an attached one say so (None = no). Weight loads then
    refresh CPU-packed tied weights (see the README); the "gloo" backend needs it."""
    salt_cache_by_version: bool = True
    """Salt every request's prefix cache with the weight version, so KV blocks computed under old
    weights are never reused. False resets the prefix cache after each update instead, which
    fails while paused requests hold blocks (pause mode "keep")."""
