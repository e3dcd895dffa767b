"""LoRA adapters on a real vLLM server (a server of its own, launched with LoRA on), and the
routed-experts wire format checked against vLLM's own encoder.

Routed experts themselves cannot be produced on CPU: vLLM 0.32 returns them only from its
"Model Runner V2", which needs Triton (GPU); a CPU server refuses `--enable-return-routed-experts`
at start-up, which the engine reports with the server's log.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import numpy as np
import pytest

from plait.errors import EngineError
from plait.models import ResolvedModel
from plait.types import ModelInput, SamplingParams
from plait_testing.lora import merged_logprob, write_random_lora
from plait_testing.trainer import random_tokens
from plait_vllm.engine import decode_routed_experts

pytestmark = pytest.mark.vllm
VOCAB = 151936


def test_lora_adapters_load_sample_and_unload(vllm_python: str, tiny_model: ResolvedModel, tmp_path: Path) -> None:
    from plait_vllm.engine import VLLMEngine
    from plait_vllm.options import VLLMOptions

    deltas = write_random_lora(tiny_model, tmp_path / "adapter")
    prompt = random_tokens(3, 8, VOCAB)
    greedy = SamplingParams(max_tokens=1, stop=[], temperature=0)

    async def body() -> None:
        engine = VLLMEngine(tiny_model, options=VLLMOptions(python=vllm_python, dtype="float32", max_model_len=512,
                                                           enable_lora=True, max_lora_rank=8,
                                                           log_path=str(tmp_path / "server.log")), seed=0)
        try:
            base = (await engine.sample(ModelInput.from_ints(prompt), 1, greedy)).sequences[0]
            await engine.load_lora_adapter("a1", str(tmp_path / "adapter"))
            adapted = (await engine.sample(ModelInput.from_ints(prompt), 1, greedy, lora="a1")).sequences[0]
            np.testing.assert_allclose(adapted.logprobs[0], merged_logprob(tiny_model, deltas, [*prompt, *adapted.tokens]),
                                       atol=2e-3)
            assert adapted.logprobs != base.logprobs
            again = (await engine.sample(ModelInput.from_ints(prompt), 1, greedy)).sequences[0]
            np.testing.assert_allclose(again.logprobs, base.logprobs, atol=1e-5)
            await engine.unload_lora_adapter("a1")
            with pytest.raises(EngineError, match="a1"):
                await engine.sample(ModelInput.from_ints(prompt), 1, greedy, lora="a1")
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 900))


def test_routed_experts_decode_vllm_encoding(vllm_python: str) -> None:
    """vLLM's encoder picks the smallest of uint8/uint16/int32; each decodes to the same ids."""
    arrays = {dtype: (np.arange(5 * 2 * 3) % 7).astype(dtype).reshape(5, 2, 3) for dtype in ("uint8", "uint16", "int32")}
    script = "import numpy as np; from vllm.utils.serial_utils import numpy2base64\n" + "".join(
        f"print(numpy2base64(np.array({a.tolist()}, dtype='{dtype}')))\n" for dtype, a in arrays.items())
    lines = subprocess.run([vllm_python, "-c", script], capture_output=True, text=True, check=True,
                           timeout=300).stdout.strip().splitlines()[-len(arrays):]
    for (dtype, routing), encoded in zip(arrays.items(), lines, strict=True):
        decoded = decode_routed_experts(encoded)
        np.testing.assert_array_equal(decoded.to_numpy(), routing, err_msg=dtype)
