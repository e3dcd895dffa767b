"""Options of the "sglang" inference engine (`inference.options` in a run config)."""

from __future__ import annotations

from typing import Literal

import attrs

from plait.api import positive
from plait_server.engine import ServerOptions


@attrs.frozen
class SGLangOptions(ServerOptions):
    """`url` attaches to a running server; `python` (default: this interpreter) launches
    `launch_module`."""

    launch_module: str = "sglang.launch_server"
    """The module `python -m` runs; "plait_sglang.fake_server" runs the CPU stand-in."""
    dtype: str | None = None
    """The server's --dtype; None follows model.dtype."""
    context_length: int = attrs.field(default=2048, validator=positive)
    mem_fraction_static: float | None = None
    """SGLang's --mem-fraction-static on a GPU (None keeps SGLang's default)."""
    keep_mode: Literal["retract", "in_place"] = "retract"
    """What pause("keep") asks of SGLang: "retract" frees the held requests' KV (they re-prefill
    with the new weights on resume; the cache is flushed on updates); "in_place" keeps their KV
    from the old weights (no flush: SGLang refuses it while requests are held)."""
    enable_lora: bool = False
    max_lora_rank: int = attrs.field(default=16, validator=positive)
    max_loras_per_batch: int = attrs.field(default=2, validator=positive)
    enable_return_routed_experts: bool = False
    """MoE models: return each token's routed experts (for routing replay; SGLang >= 0.5.7)."""
    return_original_logprob: bool = True
    """Launch with SGLANG_RETURN_ORIGINAL_LOGPROB=1: logprobs of the raw distribution (what the
    trainer computes) rather than the temperature-scaled one SGLang returns by default."""
