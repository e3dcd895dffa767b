"""Options of the "vllm" inference engine (`inference.options` in a run config)."""

from __future__ import annotations

import attrs

from plait.config import positive

VENV_ENV = "PLAIT_VLLM_VENV"
"""Environment variable naming the venv whose python runs the server when `python` is not set."""


@attrs.frozen
class VLLMOptions:
    url: str | None = None
    """Attach to a running server (e.g. "http://127.0.0.1:8000"); None launches one. An attached
    server needs `VLLM_SERVER_DEV_MODE=1` for pause and weight updates, and `--enable-scale-out`
    for per-token weight versions (without it, sampling falls back to /v1/completions)."""
    python: str | None = None
    """The interpreter with vLLM installed that launches the server; None = $PLAIT_VLLM_VENV/bin/python,
    else this interpreter."""
    host: str = "127.0.0.1"
    port: int | None = None
    """None = a free port."""
    dtype: str | None = None
    """The server's --dtype; None follows model.dtype. Logprobs match a float32 trainer only in float32."""
    max_model_len: int = attrs.field(default=2048, validator=positive)
    kv_cache_gib: int = attrs.field(default=1, validator=positive)
    """KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float | None = None
    """On a GPU: vLLM's --gpu-memory-utilization (None keeps vLLM's default)."""
    enforce_eager: bool = True
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
    server_args: list[str] = attrs.field(factory=list)
    """Extra command-line arguments for the server."""
    env: dict[str, str] = attrs.field(factory=dict)
    """Extra environment variables for the server."""
    api_key: str | None = None
    startup_timeout_s: float = attrs.field(default=900.0, validator=positive)
    """How long a launched server may take to answer /health (minutes on a loaded 2-core machine)."""
    request_timeout_s: float = attrs.field(default=600.0, validator=positive)
    """Deadline of one sampling request."""
    control_timeout_s: float = attrs.field(default=120.0, validator=positive)
    """Deadline of pause, resume, weight loading and other control calls."""
    pause_timeout_s: float | None = attrs.field(default=None, validator=attrs.validators.optional(positive))
    """How long `sample` waits while the engine is paused (None = until resume)."""
    log_path: str | None = None
    """Where a launched server's output goes; None = a temporary file (its path is logged)."""
    weights_dir: str | None = None
    """Where `apply_weights` stages safetensors for the server to load; None = a temporary directory."""
    salt_cache_by_version: bool = True
    """Salt every request's prefix cache with the weight version, so KV blocks computed under old
    weights are never reused. False resets the prefix cache after each update instead, which
    fails while paused requests hold blocks (pause mode "keep")."""
