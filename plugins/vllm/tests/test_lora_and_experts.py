"""LoRA adapters on a real vLLM server (a server of its own, launched with LoRA on), and the
routed-experts wire format checked against vLLM's own encoder.

Routed experts themselves cannot be produced on CPU: vLLM 0.32 returns them only from its
"Model Runner V2", which needs Triton (GPU); a CPU server refuses `--enable-return-routed-experts`
at start-up, which the engine reports with the server's log (checked here). Sampling them on a
MoE model and replaying them in the trainer is a `gpu` test.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from plait.api import EngineError, ModelInput, ResolvedModel, SamplingParams
from plait_testing.lora import merged_logprob, write_random_lora
from plait_testing.models import materialize_model
from plait_testing.trainer import random_tokens
from plait_vllm.engine import decode_routed_experts

pytestmark = pytest.mark.vllm
VOCAB = 151936


def test_lora_adapters_load_sample_and_unload(
    vllm_python: str, tiny_model: ResolvedModel, tmp_path: Path
) -> None:
    from plait_vllm.engine import VLLMEngine
    from plait_vllm.options import VLLMOptions

    deltas = write_random_lora(tiny_model, tmp_path / "adapter")
    prompt = random_tokens(3, 8, VOCAB)
    greedy = SamplingParams(max_tokens=1, stop=[], temperature=0)

    async def body() -> None:
        engine = VLLMEngine(
            tiny_model,
            options=VLLMOptions(
                python=vllm_python,
                dtype="float32",
                max_model_len=512,
                enable_lora=True,
                max_lora_rank=8,
                log_path=str(tmp_path / "server.log"),
            ),
            seed=0,
        )
        try:
            base = (await engine.sample(ModelInput.from_ints(prompt), 1, greedy)).sequences[0]
            await engine.load_lora_adapter("a1", str(tmp_path / "adapter"))
            adapted = (
                await engine.sample(ModelInput.from_ints(prompt), 1, greedy, lora="a1")
            ).sequences[0]
            np.testing.assert_allclose(
                adapted.logprobs[0],
                merged_logprob(tiny_model, deltas, [*prompt, *adapted.tokens]),
                atol=2e-3,
            )
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
    """vLLM's encoder picks the smallest of uint8/uint16/int32 for the model's experts; each
    decodes to the same ids, kept in that narrow dtype (ids that fit a narrower one are
    narrowed)."""
    ids = np.arange(5 * 2 * 3).reshape(5, 2, 3)
    arrays = {"uint8": ids * 8, "uint16": ids * 300, "int32": ids * 3000, "uint16 ": ids % 7}
    script = "import numpy as np; from vllm.utils.serial_utils import numpy2base64\n" + "".join(
        f"print(numpy2base64(np.array({a.tolist()}, dtype='{dtype.strip()}')))\n"
        for dtype, a in arrays.items()
    )
    lines = (
        subprocess.run(
            [vllm_python, "-c", script], capture_output=True, text=True, check=True, timeout=300
        )
        .stdout.strip()
        .splitlines()[-len(arrays) :]
    )
    for (dtype, routing), encoded in zip(arrays.items(), lines, strict=True):
        decoded = decode_routed_experts(encoded)
        np.testing.assert_array_equal(decoded.to_numpy(), routing, err_msg=dtype)
        assert (
            decoded.dtype
            == ("uint8" if dtype == "uint16 " else dtype)
            == decoded.to_numpy().dtype.name
        )


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> ResolvedModel:
    """tiny-qwen3-moe: a random 2-layer Qwen3-MoE, 8 experts, 2 per token."""
    return materialize_model(
        "tiny-qwen3-moe", Path(tmp_path_factory.mktemp("models")) / "tiny-qwen3-moe"
    )


def test_a_cpu_server_refuses_routed_experts_at_start_up_with_its_log(
    vllm_python: str, tiny_moe: ResolvedModel, tmp_path: Path
) -> None:
    """vLLM 0.32's CPU build has no Model Runner V2, which routed experts need: the server exits
    while starting (it validates its config before loading the model), and the engine's error
    carries the server's own reason."""
    from plait_vllm.engine import VLLMEngine, is_cpu_build
    from plait_vllm.options import VLLMOptions

    if not is_cpu_build(vllm_python):
        pytest.skip("a GPU build of vLLM serves routed experts (see the gpu test)")

    async def body() -> None:
        engine = VLLMEngine(
            tiny_moe,
            options=VLLMOptions(
                python=vllm_python,
                dtype="float32",
                max_model_len=512,
                enable_return_routed_experts=True,
                log_path=str(tmp_path / "server.log"),
            ),
            seed=0,
        )
        try:
            with pytest.raises(
                EngineError, match=r"(?s)exited with code .* while starting.*Model Runner V2"
            ):
                await engine.sample(
                    ModelInput.from_ints([1, 2, 3]), 1, SamplingParams(max_tokens=2, stop=[])
                )
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 300))


def test_a_cpu_server_refuses_weight_updates_of_a_mixture_of_experts(
    vllm_python: str, tiny_moe: ResolvedModel, tmp_path: Path
) -> None:
    """vLLM 0.32's CPU backend serves a mixture of experts but reloads its weights wrongly (the same
    checkpoint reloaded in place changes the logprobs; measured), so an update is refused with
    what to do instead, rather than leaving the sampler on a policy nobody trained."""
    from safetensors.torch import load_file

    from plait.api import WeightUpdate
    from plait_vllm.engine import VLLMEngine, is_cpu_build
    from plait_vllm.options import VLLMOptions

    if not is_cpu_build(vllm_python):
        pytest.skip("a GPU build of vLLM")

    async def body() -> None:
        engine = VLLMEngine(
            tiny_moe,
            options=VLLMOptions(
                python=vllm_python,
                dtype="float32",
                max_model_len=512,
                log_path=str(tmp_path / "server.log"),
            ),
            seed=0,
        )
        try:
            sampled = await engine.sample(
                ModelInput.from_ints([1, 2, 3]), 1, SamplingParams(max_tokens=2, stop=[])
            )
            assert len(sampled.sequences[0].tokens) == 2  # it serves the model
            same = load_file(str(next(Path(tiny_moe.path).glob("*.safetensors"))))
            with pytest.raises(EngineError, match="mixture-of-experts") as caught:
                await engine.apply_weights(WeightUpdate(version=1, tensors=same))
            assert "inference.engine = 'torch'" in caught.value.fix
            assert engine.weight_version == 0
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 300))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (and a GPU build of vLLM)"
)
def test_routed_experts_sampled_by_vllm_are_replayed_by_the_trainer(
    vllm_python: str, tiny_moe: ResolvedModel, tmp_path: Path
) -> None:
    """R3 end to end: vLLM returns the experts of every token it ran but the last sampled one, and a
    float32 plait-torch trainer replaying them uses exactly those experts, which its own routers
    mostly agree with (both float32)."""
    from plait.api import Datum
    from plait_torch.options import TorchTrainerOptions
    from plait_torch.trainer import TorchTrainer
    from plait_vllm.engine import VLLMEngine
    from plait_vllm.options import VLLMOptions

    prompt = random_tokens(5, 12, VOCAB)

    async def body() -> Any:
        engine = VLLMEngine(
            tiny_moe,
            options=VLLMOptions(
                python=vllm_python,
                dtype="float32",
                max_model_len=512,
                enable_return_routed_experts=True,
                gpu_memory_utilization=0.3,
                log_path=str(tmp_path / "server.log"),
            ),
            seed=0,
        )
        try:
            return (
                await engine.sample(
                    ModelInput.from_ints(prompt), 1, SamplingParams(max_tokens=8, stop=[], seed=1)
                )
            ).sequences[0]
        finally:
            await engine.close()

    sequence = asyncio.run(asyncio.wait_for(body(), 900))
    tokens = list(sequence.tokens)
    routed = sequence.routed_experts
    assert routed is not None and routed.dtype == "uint8"  # 8 experts
    assert routed.shape == (len(prompt) + len(tokens) - 1, 2, 2)
    assert int(routed.to_numpy().max()) < 8

    full = [*prompt, *tokens]
    datum = Datum(
        ModelInput.from_ints(full[:-1]),
        {
            "target_tokens": full[1:],
            "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(tokens),
            "routed_experts": routed,
        },
    )
    trainer = TorchTrainer(tiny_moe, options=TorchTrainerOptions(routing_replay=True))
    try:
        output = trainer.forward([datum], "cross_entropy")
    finally:
        trainer.close()
    assert output.metrics["routing_agreement:mean"] == 1.0  # the replayed experts are the ones used
    assert output.metrics["routing_natural_agreement:mean"] > 0.9
