"""plait-torch inference specifics beyond the contract kit."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from plait.api import (
    DataError,
    EngineError,
    ModelInput,
    ResolvedModel,
    SamplingParams,
    WeightUpdate,
)
from plait_testing.inference import run_with
from plait_testing.trainer import random_tokens
from plait_torch.inference import TorchInferenceEngine
from plait_torch.options import TorchInferenceOptions

VOCAB = 151936


def prompt(seed: int = 0, length: int = 6) -> ModelInput:
    return ModelInput.from_ints(random_tokens(seed, length, VOCAB))


def test_logprobs_equal_a_plain_transformers_forward(tiny_model: ResolvedModel) -> None:
    from transformers import AutoModelForCausalLM

    engine = TorchInferenceEngine(tiny_model)
    response = run_with(
        lambda: engine,
        lambda e: e.sample(
            prompt(), 3, SamplingParams(max_tokens=6, stop=[], seed=4, temperature=1.5)
        ),
    )
    reference = AutoModelForCausalLM.from_pretrained(
        str(tiny_model.path), local_files_only=True
    ).eval()
    for seq in response.sequences:
        ids = torch.tensor([prompt().to_ints() + list(seq.tokens)])
        with torch.no_grad():
            logp = torch.log_softmax(reference(ids).logits[0].double(), -1)
        expected = [float(logp[prompt().length - 1 + i, t]) for i, t in enumerate(seq.tokens)]
        np.testing.assert_allclose(seq.logprobs, expected, atol=1e-4)


def count_forward_rows(engine: TorchInferenceEngine) -> list[int]:
    """Records the batch size of every model forward the engine runs."""
    calls: list[int] = []
    forward = engine.model.forward

    def counting_forward(*args: Any, **kwargs: Any) -> Any:
        calls.append(int(kwargs["input_ids"].shape[0]))
        return forward(*args, **kwargs)

    engine.model.forward = counting_forward
    return calls


def test_identical_prompts_are_prefilled_once(tiny_model: ResolvedModel) -> None:
    """Requests with the same prompt (a GRPO group) share one prefill; results stay per-seed."""
    engine = TorchInferenceEngine(tiny_model)
    calls = count_forward_rows(engine)

    async def body(e: TorchInferenceEngine) -> list[tuple[int, ...]]:
        group = await asyncio.gather(
            *[
                e.sample(prompt(), 1, SamplingParams(max_tokens=2, stop=[], seed=s))
                for s in range(4)
            ]
        )
        return [r.sequences[0].tokens for r in group]

    tokens = run_with(lambda: engine, body)
    assert calls[0] == 1, f"the prefill ran on {calls[0]} rows for one distinct prompt"
    assert calls[1] == 4 and len(set(tokens)) == 4


def test_the_output_projection_gets_contiguous_rows_in_every_pass(
    tiny_model: ResolvedModel,
) -> None:
    """A prefill of prompts of different lengths keeps each one's last position: a strided view,
    which made CPU bfloat16 matmul copy the whole 152k-row projection per row (a prefill of 19
    prompts took 2.5 s in the head alone); the engine hands the head contiguous rows."""
    engine = TorchInferenceEngine(tiny_model, options=TorchInferenceOptions(dtype="bfloat16"))
    contiguous: list[bool] = []
    engine.model.get_output_embeddings().register_forward_hook(
        lambda _module, args, _out: contiguous.append(args[0].is_contiguous())
    )

    async def body(e: TorchInferenceEngine) -> None:
        await asyncio.gather(
            *[
                e.sample(prompt(seed, length), 2, SamplingParams(max_tokens=3, stop=[], seed=seed))
                for seed, length in enumerate([5, 9, 12])
            ]
        )

    run_with(lambda: engine, body)
    assert len(contiguous) >= 3 and all(contiguous), contiguous


def staggered_batches(engine: TorchInferenceEngine) -> list[int]:
    """Rows of each batch the engine decodes when 6 requests arrive 2 ms apart (as a rollout
    step's episodes do when their environments run code in threads)."""
    batches: list[int] = []
    take = engine._take_batch

    def recording_take() -> Any:
        requests = take()
        batches.append(sum(len(r.rows) for r in requests))
        return requests

    engine._take_batch = recording_take  # type: ignore[method-assign]

    async def body(e: TorchInferenceEngine) -> None:
        async def late(index: int) -> Any:
            await asyncio.sleep(0.002 * index)
            return await e.sample(prompt(index), 1, SamplingParams(max_tokens=2, stop=[]))

        await asyncio.gather(*(late(i) for i in range(6)))

    run_with(lambda: engine, body)
    return batches


def test_requests_arriving_over_milliseconds_share_one_batch(tiny_model: ResolvedModel) -> None:
    assert staggered_batches(
        TorchInferenceEngine(tiny_model, options=TorchInferenceOptions(batch_wait_ms=500))
    ) == [6]
    # Waiting only for quiet event-loop turns, the first request starts a batch of its own.
    assert (
        staggered_batches(
            TorchInferenceEngine(tiny_model, options=TorchInferenceOptions(batch_wait_ms=0))
        )[0]
        < 6
    )


def test_all_compute_runs_on_one_worker_thread(tiny_model: ResolvedModel) -> None:
    """torch's CPU thread pool belongs to the calling thread: one worker means one pool."""
    import threading

    engine = TorchInferenceEngine(tiny_model)
    threads: set[int] = set()
    forward = engine.model.forward

    def recording_forward(*args: Any, **kwargs: Any) -> Any:
        threads.add(threading.get_ident())
        return forward(*args, **kwargs)

    engine.model.forward = recording_forward

    async def body(e: TorchInferenceEngine) -> None:
        for seed in range(3):  # successive batches
            await asyncio.gather(
                *(
                    e.sample(prompt(seed + i), 2, SamplingParams(max_tokens=3, stop=[]))
                    for i in range(2)
                )
            )
        await e.compute_logprobs(prompt())

    run_with(lambda: engine, body)
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_a_prefix_every_prompt_shares_is_prefilled_once(tiny_model: ResolvedModel) -> None:
    """Three prompts that start with the same 20 tokens (a system prompt, worked examples) and end
    differently (1, 3 and 6 tokens): the 20 run once, then the three rests; tokens and logprobs
    are those of a prefill without sharing, so also of a plain forward (the test above)."""
    shared = random_tokens(7, 20, VOCAB)
    prompts = [
        ModelInput.from_ints(shared + random_tokens(seed, length, VOCAB))
        for seed, length in ((1, 1), (2, 3), (3, 6))
    ]
    params = SamplingParams(max_tokens=5, stop=[], seed=2, temperature=1.5)

    async def body(e: TorchInferenceEngine) -> list[Any]:
        await e.pause("keep")  # queue all three, then let the scheduler take them as one batch
        tasks = [asyncio.ensure_future(e.sample(p, 2, params)) for p in prompts]
        await asyncio.sleep(0)
        await e.resume()
        return [seq for response in await asyncio.gather(*tasks) for seq in response.sequences]

    sharing = TorchInferenceEngine(tiny_model)
    calls = count_forward_rows(sharing)
    shared_run = run_with(lambda: sharing, body)
    assert calls[:3] == [1, 3, 6], (
        f"expected the prefix (1 row), the rests (3 rows), then decoding: {calls[:3]}"
    )
    plain = run_with(
        lambda: TorchInferenceEngine(
            tiny_model, options=TorchInferenceOptions(prefix_sharing=False)
        ),
        body,
    )
    for a, b in zip(shared_run, plain, strict=True):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_max_model_len_bounds_prompt_and_completion(tiny_model: ResolvedModel) -> None:
    engine = TorchInferenceEngine(tiny_model, options=TorchInferenceOptions(max_model_len=9))

    async def body(e: TorchInferenceEngine) -> None:
        seq = (
            await e.sample(prompt(length=6), 1, SamplingParams(max_tokens=10, stop=[]))
        ).sequences[0]
        assert len(seq.tokens) == 3 and seq.stop_reason == "length"
        with pytest.raises(DataError, match="max_model_len 9"):
            await e.sample(prompt(length=9), 1, SamplingParams(max_tokens=1))

    run_with(lambda: engine, body)


def test_a_cancelled_request_leaves_the_batch(tiny_model: ResolvedModel) -> None:
    engine = TorchInferenceEngine(tiny_model)
    calls = count_forward_rows(engine)

    async def body(e: TorchInferenceEngine) -> None:
        doomed = asyncio.ensure_future(
            e.sample(prompt(1), 2, SamplingParams(max_tokens=500, stop=[]))
        )
        kept = asyncio.ensure_future(e.sample(prompt(2), 1, SamplingParams(max_tokens=12, stop=[])))
        await e.sample(prompt(3), 1, SamplingParams(max_tokens=1, stop=[]))  # the batch is running
        doomed.cancel()
        assert len((await kept).sequences[0].tokens) == 12
        assert (
            len(
                (await e.sample(prompt(4), 1, SamplingParams(max_tokens=2, stop=[])))
                .sequences[0]
                .tokens
            )
            == 2
        )
        assert (await e.health()).ok

    run_with(lambda: engine, body)
    # The cancelled rows were dropped, not decoded on to 500 tokens: the batch ended with the kept
    # one.
    assert len(calls) < 30, f"{len(calls)} forward passes"


def test_bad_weight_updates_are_rejected_whole(tiny_model: ResolvedModel) -> None:
    engine = TorchInferenceEngine(tiny_model)
    weights = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    name = next(iter(weights))

    async def body(e: TorchInferenceEngine) -> None:
        before = (
            await e.sample(prompt(), 1, SamplingParams(max_tokens=3, stop=[], seed=1))
        ).sequences[0]
        bad_updates = {
            "unknown": {**weights, "model.no_such.weight": weights[name]},
            "lacks": {k: v for k, v in weights.items() if k != name},
            "shape": {**weights, name: weights[name][:1]},
        }
        for problem, tensors in bad_updates.items():
            broken = {k: (v * 0 if problem != "shape" else v) for k, v in tensors.items()}
            with pytest.raises(EngineError, match=problem):
                await e.apply_weights(WeightUpdate(7, broken))
        with pytest.raises(EngineError, match="TensorPatch"):
            await e.apply_weights(WeightUpdate(7, weights, kind="delta"))
        assert e.weight_version == 0
        after = (
            await e.sample(prompt(), 1, SamplingParams(max_tokens=3, stop=[], seed=1))
        ).sequences[0]
        assert after.tokens == before.tokens and after.logprobs == before.logprobs, (
            "a rejected update changed weights"
        )
        await e.apply_weights(
            WeightUpdate(3, {k: v.numpy() for k, v in weights.items()})
        )  # numpy arrays work
        assert e.weight_version == 3

    run_with(lambda: engine, body)


def test_close_fails_pending_requests(tiny_model: ResolvedModel) -> None:
    engine = TorchInferenceEngine(tiny_model)

    async def main() -> None:
        pending = asyncio.ensure_future(
            engine.sample(prompt(), 1, SamplingParams(max_tokens=2000, stop=[]))
        )
        await engine.sample(prompt(1), 1, SamplingParams(max_tokens=1, stop=[]))
        await engine.close()
        with pytest.raises(EngineError, match="closed"):
            await pending
        assert not (await engine.health()).ok
        with pytest.raises(EngineError, match="closed"):
            await engine.sample(prompt(), 1, SamplingParams(max_tokens=1))

    asyncio.run(main())


def test_one_engine_serves_successive_event_loops(tiny_model: ResolvedModel) -> None:
    engine = TorchInferenceEngine(tiny_model)
    params = SamplingParams(max_tokens=3, stop=[], seed=9)
    first = asyncio.run(engine.sample(prompt(), 1, params))
    second = asyncio.run(engine.sample(prompt(), 1, params))
    assert first.sequences[0].tokens == second.sequences[0].tokens


def test_weights_applied_without_pause_take_effect_between_steps(tiny_model: ResolvedModel) -> None:
    engine = TorchInferenceEngine(tiny_model)
    weights = {name: p.detach().clone() for name, p in engine.model.named_parameters()}

    async def body(e: TorchInferenceEngine) -> tuple[int, ...]:
        long = asyncio.ensure_future(e.sample(prompt(1), 1, SamplingParams(max_tokens=40, stop=[])))
        await e.sample(prompt(2), 1, SamplingParams(max_tokens=1, stop=[]))  # the batch is running
        await e.apply_weights(WeightUpdate(1, weights))
        return (await long).sequences[0].versions()

    versions = run_with(lambda: engine, body)
    assert versions[0] == 0 and versions[-1] == 1 and list(versions) == sorted(versions)


def rows_scoring_alone_then_together(model: ResolvedModel, prompts: list[ModelInput]) -> list[int]:
    """The rows of every forward pass that scoring `prompts` one call at a time, then all calls
    at once, runs; each call at once must get what it got alone."""
    engine = TorchInferenceEngine(model)
    rows = count_forward_rows(engine)

    async def body(e: TorchInferenceEngine) -> tuple[list[Any], list[Any]]:
        alone = [await e.compute_logprobs(p) for p in prompts]
        return alone, list(await asyncio.gather(*(e.compute_logprobs(p) for p in prompts)))

    alone, together = run_with(lambda: engine, body)
    for one, batched, p in zip(alone, together, prompts, strict=True):
        assert len(batched) == p.length and one[0] is None and batched[0] is None
        np.testing.assert_allclose(batched[1:], one[1:], atol=1e-5)
    return rows


def test_concurrent_compute_logprobs_calls_share_a_forward_pass(tiny_model: ResolvedModel) -> None:
    """Calls that wait together (a run scoring each episode for its KL reference as it ends) run
    as one batch, and each gets what it would alone."""
    prompts = [prompt(seed, n) for seed, n in enumerate([12] * 6)]
    rows = rows_scoring_alone_then_together(tiny_model, prompts)
    assert rows == [1] * len(prompts) + [len(prompts)]


def test_concurrent_compute_logprobs_calls_run_a_shared_prefix_once(
    tiny_model: ResolvedModel,
) -> None:
    """The samples of one task, scored together: their 20-token prompt runs once, then their
    different completions (1 to 9 tokens) in one pass, each scored as it would be alone."""
    shared = random_tokens(7, 20, VOCAB)
    prompts = [
        ModelInput.from_ints(shared + random_tokens(seed, n, VOCAB))
        for seed, n in enumerate([1, 4, 9, 2])
    ]
    rows = rows_scoring_alone_then_together(tiny_model, prompts)
    assert rows == [1] * len(prompts) + [1, len(prompts)]  # alone; then the prefix, the rests


def test_closing_fails_the_compute_logprobs_calls_that_wait(tiny_model: ResolvedModel) -> None:
    """Calls waiting for a pass (the model busy: its lock held here) fail as closed, none hangs."""
    engine = TorchInferenceEngine(tiny_model)

    async def body(e: TorchInferenceEngine) -> list[Any]:
        e._bind()
        await e._model_lock.acquire()  # another pass runs
        calls = [asyncio.ensure_future(e.compute_logprobs(prompt(seed, 12))) for seed in range(3)]
        await asyncio.sleep(0)
        await e.close()
        return list(await asyncio.gather(*calls, return_exceptions=True))

    results = run_with(lambda: engine, body)
    assert all(isinstance(r, EngineError) and "closed" in str(r) for r in results), results
