"""Model FLOPs per token and the device's peak FLOP/s, for MFU (see the metrics reference).

MFU = achieved model FLOP/s / peak FLOP/s. On a CPU the peak is measured once per process by a
short matmul benchmark and cached; on a known GPU it comes from a table of dense datasheet peaks.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import attrs
import torch


def transformer_flops_per_token(
    non_embedding_params: int, num_layers: int, hidden_size: int, seq_len: int
) -> float:
    """Training FLOPs per token: 6·N plus the attention term 12·L·H·S (forward + backward)."""
    return 6.0 * non_embedding_params + 12.0 * num_layers * hidden_size * seq_len


# Dense (no sparsity) datasheet peaks in FLOP/s, by a substring of torch.cuda.get_device_name().
_GPU_PEAKS: dict[str, dict[torch.dtype, float]] = {
    "H200": {torch.bfloat16: 989e12, torch.float32: 67e12},
    "H100": {torch.bfloat16: 989e12, torch.float32: 67e12},
    "A100": {torch.bfloat16: 312e12, torch.float32: 19.5e12},
    "L40S": {torch.bfloat16: 362e12, torch.float32: 91.6e12},
    "A10": {torch.bfloat16: 125e12, torch.float32: 31.2e12},
}


@attrs.frozen
class PeakFlops:
    flops_per_s: float
    source: str  # "measured (...)" or "datasheet (...)"


@functools.cache
def peak_flops(device_type: str, dtype: torch.dtype) -> PeakFlops:
    """The peak matmul FLOP/s of this process's `device_type` in `dtype` (cached per process)."""
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        for key, peaks in _GPU_PEAKS.items():
            if key in name and dtype in peaks:
                return PeakFlops(
                    peaks[dtype], f"datasheet ({name}, {str(dtype).removeprefix('torch.')})"
                )
    return PeakFlops(
        measure_matmul_flops(torch.device(device_type), dtype),
        f"measured ({device_type} matmul, {str(dtype).removeprefix('torch.')})",
    )


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.3
) -> float:
    """Best FLOP/s of square matmuls in `dtype` over about `seconds` of repeats."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    flops = 2.0 * size**3
    best = float("inf")
    _sync(device)
    torch.matmul(a, b)  # warm-up: kernel selection, thread pool start
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        _sync(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
        runs += 1
    return flops / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@attrs.frozen
class FlopsModel:
    """Training FLOPs per token of a decoder-only transformer: 6·N + 12·L·A·S.

    N counts every parameter that takes part in a matmul: all parameters except the input
    embedding table, which is a lookup. The output projection counts even when it is tied to the
    input embedding, because it is a full matmul per token (for small models with large
    vocabularies it is most of the work). A = attention width (heads x head_dim), S = sequence
    length.
    """

    matmul_params: int
    num_layers: int
    attention_width: int

    @classmethod
    def of(cls, hf_model: Any) -> FlopsModel:
        config = hf_model.config
        embedding = hf_model.get_input_embeddings().weight
        params = {id(p): p.numel() for p in hf_model.parameters()}  # tied parameters counted once
        matmul_params = sum(params.values()) - embedding.numel()
        if id(hf_model.get_output_embeddings().weight) == id(embedding):
            matmul_params += embedding.numel()
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(int(matmul_params), int(config.num_hidden_layers), int(heads * head_dim))

    def train_flops_per_token(self, seq_len: int) -> float:
        return transformer_flops_per_token(
            self.matmul_params, self.num_layers, self.attention_width, seq_len
        )

    def forward_flops_per_token(self, seq_len: int) -> float:
        return self.train_flops_per_token(seq_len) / 3.0  # backward costs twice the forward
