"""plait-torch inference: routing replay (R3) recording and the sampling dtype."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from plait.api import ConfigError, ModelInput, ResolvedModel, SampledSequence, SamplingParams
from plait_testing.inference import run_with
from plait_testing.trainer import random_tokens
from plait_torch.inference import TorchInferenceEngine
from plait_torch.options import TorchInferenceOptions
from plait_train.routing import RoutingHooks

VOCAB = 151936
LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def reference(tiny_moe: ResolvedModel) -> Callable[[list[int]], np.ndarray]:
    """The routing of an unbatched float32 forward over `tokens`: (tokens, layers, top_k)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_moe.path), dtype=torch.float32, local_files_only=True
    ).eval()
    hooks = RoutingHooks(model)

    def routing(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            model(torch.tensor([tokens]), use_cache=False)
        return hooks.stacked(hooks.chosen).numpy()

    return routing


def recording(model: ResolvedModel, **options: Any) -> TorchInferenceEngine:
    return TorchInferenceEngine(
        model,
        options=TorchInferenceOptions(device="cpu", enable_return_routed_experts=True, **options),
    )


def check_routing(
    seq: SampledSequence, prompt: list[int], reference: Callable[[list[int]], np.ndarray]
) -> None:
    """Shape, dtype, and the same experts (as sets) as an unbatched forward over
    prompt + tokens[:-1]."""
    assert seq.routed_experts is not None
    assert seq.routed_experts.dtype == "uint8"
    routed = seq.routed_experts.to_numpy()
    assert routed.dtype == np.uint8
    assert routed.shape == (len(prompt) + len(seq.tokens) - 1, LAYERS, TOP_K)
    expected = reference([*prompt, *seq.tokens][:-1])
    np.testing.assert_array_equal(np.sort(routed, -1), np.sort(expected, -1))


def test_one_prompt_records_the_routing_of_every_fed_token(
    tiny_moe: ResolvedModel, reference
) -> None:
    ids = random_tokens(0, 7, VOCAB)
    response = run_with(
        lambda: recording(tiny_moe),
        lambda e: e.sample(
            ModelInput.from_ints(ids), 3, SamplingParams(max_tokens=6, stop=[], seed=1)
        ),
    )
    for seq in response.sequences:
        assert len(seq.tokens) == 6
        check_routing(seq, ids, reference)


def test_batched_prompts_of_different_lengths_keep_padding_out(
    tiny_moe: ResolvedModel, reference
) -> None:
    """Three prompts (3, 8 and 13 tokens, left-padded into one prefill), n = 2 or 3 each, with
    different max_tokens so that rows leave the batch at different steps."""
    prompts = [random_tokens(seed, length, VOCAB) for seed, length in ((1, 3), (2, 8), (3, 13))]
    budgets = [2, 9, 5]

    async def body(e: TorchInferenceEngine) -> list[Any]:
        await e.pause("keep")  # queue all three, then let the scheduler take them as one batch
        tasks = [
            asyncio.ensure_future(
                e.sample(ModelInput.from_ints(p), n, SamplingParams(max_tokens=m, stop=[], seed=s))
            )
            for s, (p, m, n) in enumerate(zip(prompts, budgets, (2, 3, 2), strict=True))
        ]
        await asyncio.sleep(0)
        await e.resume()
        return await asyncio.gather(*tasks)

    engine = recording(tiny_moe)
    rows: list[int] = []
    forward = engine.model.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        rows.append(int(kwargs["input_ids"].shape[0]))
        return forward(*args, **kwargs)

    engine.model.forward = counting
    responses = run_with(lambda: engine, body)
    assert rows[:2] == [3, 7], "the three requests should share one prefill and one batch"
    for ids, budget, response in zip(prompts, budgets, responses, strict=True):
        for seq in response.sequences:
            assert len(seq.tokens) == budget
            check_routing(seq, ids, reference)


def test_a_shared_prefix_records_the_same_routing(tiny_moe: ResolvedModel, reference) -> None:
    """Prompts that start with the same 18 tokens run them once (prefix_sharing): each sample's
    routing still covers its whole prompt."""
    shared = random_tokens(9, 18, VOCAB)
    prompts = [shared + random_tokens(seed, length, VOCAB) for seed, length in ((4, 2), (5, 5))]

    async def body(e: TorchInferenceEngine) -> list[Any]:
        await e.pause("keep")
        tasks = [
            asyncio.ensure_future(
                e.sample(ModelInput.from_ints(p), 2, SamplingParams(max_tokens=4, stop=[], seed=s))
            )
            for s, p in enumerate(prompts)
        ]
        await asyncio.sleep(0)
        await e.resume()
        return await asyncio.gather(*tasks)

    for ids, response in zip(prompts, run_with(lambda: recording(tiny_moe), body), strict=True):
        for seq in response.sequences:
            check_routing(seq, ids, reference)


def test_off_by_default(tiny_moe: ResolvedModel) -> None:
    engine = TorchInferenceEngine(tiny_moe, options=TorchInferenceOptions(device="cpu"))
    response = run_with(
        lambda: engine,
        lambda e: e.sample(
            ModelInput.from_ints(random_tokens(4, 5, VOCAB)),
            2,
            SamplingParams(max_tokens=3, stop=[], seed=0),
        ),
    )
    assert all(seq.routed_experts is None for seq in response.sequences)


def test_dense_model_is_a_config_error(tiny_model: ResolvedModel) -> None:
    with pytest.raises(ConfigError) as caught:
        recording(tiny_model)
    assert "inference.options.enable_return_routed_experts" in str(caught.value)
    assert "not a mixture of experts" in str(caught.value)


def test_bfloat16_samples_close_to_float32(tiny_moe: ResolvedModel) -> None:
    """dtype = bfloat16 samples in bfloat16 (a float32 checkpoint): its logprobs are close to, not
    equal to, float32's for the same tokens."""
    ids = random_tokens(5, 6, VOCAB)
    half = TorchInferenceEngine(
        tiny_moe, options=TorchInferenceOptions(device="cpu", dtype="bfloat16")
    )
    assert next(half.model.parameters()).dtype == torch.bfloat16
    seq = run_with(
        lambda: half,
        lambda e: e.sample(
            ModelInput.from_ints(ids), 1, SamplingParams(max_tokens=8, stop=[], seed=3)
        ),
    ).sequences[0]
    full = TorchInferenceEngine(tiny_moe, options=TorchInferenceOptions(device="cpu"))
    assert next(full.model.parameters()).dtype == torch.float32
    expected = run_with(
        lambda: full, lambda e: e.compute_logprobs(ModelInput.from_ints([*ids, *seq.tokens]))
    )[len(ids) :]
    np.testing.assert_allclose(seq.logprobs, expected, atol=0.1)
    assert not np.allclose(seq.logprobs, expected, rtol=0, atol=1e-5)


def test_aborted_requests_keep_consistent_routing(tiny_moe: ResolvedModel, reference) -> None:
    """pause("abort") mid-decode: each row has prompt + tokens - 1 rows of routing, matching a
    plain forward; a request still queued ran nothing and has none."""
    running_ids, queued_ids = random_tokens(6, 5, VOCAB), random_tokens(7, 4, VOCAB)
    engine = recording(tiny_moe, max_batch_size=2)
    steps = 0
    forward = engine.model.forward

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal steps
        steps += 1
        return forward(*args, **kwargs)

    engine.model.forward = counting

    async def body(e: TorchInferenceEngine) -> tuple[Any, Any]:
        running = asyncio.ensure_future(
            e.sample(
                ModelInput.from_ints(running_ids),
                2,
                SamplingParams(max_tokens=400, stop=[], seed=0),
            )
        )
        queued = asyncio.ensure_future(
            e.sample(
                ModelInput.from_ints(queued_ids), 1, SamplingParams(max_tokens=4, stop=[], seed=0)
            )
        )
        while steps < 4:
            await asyncio.sleep(0.005)
        await e.pause("abort")
        return await running, await queued

    running, queued = run_with(lambda: engine, body)
    for seq in running.sequences:
        assert seq.stop_reason == "abort" and 3 <= len(seq.tokens) < 400
        check_routing(seq, running_ids, reference)
    (empty,) = queued.sequences
    assert empty.stop_reason == "abort" and empty.tokens == () and empty.routed_experts is None
