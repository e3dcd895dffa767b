"""Contract tests for inference engines (`plait.protocols.InferenceEngine`).

An inference plugin subclasses `InferenceEngineContract` in its own tests and provides:

    from plait_testing.inference import InferenceEngineContract

    class TestMyEngine(InferenceEngineContract):
        @pytest.fixture
        def model(self, tiny_model):           # a ResolvedModel (a small checkpoint)
            return tiny_model

        @pytest.fixture
        def make_engine(self, model):          # () -> a fresh engine on the model's initial weights
            return lambda: MyEngine(model, options=..., seed=0)

The reference for logprobs and weight updates is a trainer engine on the same model: by default
the registered trainer named `reference_trainer` ("torch"; the test is skipped when it is not
installed); override the `make_trainer` fixture to use another. The engine's sampled-token
logprobs must match the trainer's forward on the same weights, which is what makes importance
ratios in RL meaningful.

Every test runs its own event loop (`asyncio.run`) with a timeout, so a hang fails instead of
blocking the suite.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import pytest

from plait.api import (
    AdamParams,
    InferenceEngine,
    ModelInput,
    PlaitError,
    ResolvedModel,
    SampledSequence,
    SamplingParams,
    TrainerEngine,
    UnknownComponentError,
    WeightUpdate,
)
from plait_testing.trainer import datum_logprobs, random_tokens, sft_datum, vocab_size

MakeEngine = Callable[[], InferenceEngine]
MakeTrainer = Callable[[], TrainerEngine]
E = TypeVar("E", bound=InferenceEngine)


def run_with(
    make_engine: Callable[[], E], body: Callable[[E], Awaitable[Any]], timeout_s: float = 120
) -> Any:
    """Run `body(engine)` on a fresh engine in a new event loop, with a timeout; close it after."""

    async def main() -> Any:
        engine = make_engine()
        try:
            return await asyncio.wait_for(body(engine), timeout_s)
        finally:
            await engine.close()

    return asyncio.run(main())


def assert_greedy_top_logprobs(make_engine: MakeEngine, k: int = 3, tokens: int = 5) -> None:
    """`SamplingParams.top_logprobs`: each greedy token comes with the k most likely, itself
    first with its own logprob, in descending order."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, stop=[], top_logprobs=k)
    response = run_with(make_engine, lambda e: e.sample(ModelInput.from_ints([1, 2, 3]), 1, params))
    sequence = response.sequences[0]
    assert sequence.top_logprobs is not None and len(sequence.top_logprobs) == tokens
    for token, logprob, top in zip(
        sequence.tokens, sequence.logprobs, sequence.top_logprobs, strict=True
    ):
        assert len(top) == k and top[0][0] == token
        assert top[0][1] == pytest.approx(logprob, abs=1e-4)
        assert all(a[1] >= b[1] for a, b in itertools.pairwise(top))


class InferenceEngineContract:
    """The promises of `plait.protocols.InferenceEngine`, checked against a small model."""

    logprob_atol: float = 2e-3
    """Engine vs trainer logprobs of the same tokens on the same weights agree within this."""
    reference_trainer: str = "torch"
    timeout_s: float = 120.0
    prompt_len: int = 7
    in_flight_probes: int = 1
    """One-token requests that `start_long_request` sends one after another. An engine behind a
    server should say 2: its requests travel on separate connections, so a probe sent with the
    long request can reach the server first (seen under load); the second leaves a whole round
    trip after it. An in-process engine that batches in arrival order needs 1 (a later probe
    there waits for the running batch, so the long request would finish first)."""
    settle_probe_round_trips: float = 0.0
    """Before an abort, `start_long_request(settle=True)` also waits this many times the slowest
    probe's round trip. An engine behind a server should say 2: the probes prove the long request
    reached the batch, not that its first tokens streamed back, and the client reads them only
    when its own event loop gets to it (an abort with nothing read returns no tokens: seen on a
    loaded machine)."""
    abort_request_tokens: int = 1000
    """max_tokens of the request the abort test pauses: long enough that the pause lands before
    it ends, within the engine's context."""
    keep_request_tokens: int = 256
    """max_tokens of the request the keep test pauses mid-stream (it runs to the end after the
    resume, so no longer than needed)."""
    takes_weight_updates: bool = True
    """False for an engine that serves a fixed checkpoint: `apply_weights` must then fail with a
    plait error that names the fix, the two tests that train the model skip, and the "keep" pause
    test checks holding and continuing without new weights."""

    @pytest.fixture
    def model(self) -> ResolvedModel:
        raise NotImplementedError("subclass InferenceEngineContract and provide a `model` fixture")

    @pytest.fixture
    def make_engine(self, model: ResolvedModel) -> MakeEngine:
        raise NotImplementedError(
            "subclass InferenceEngineContract and provide a `make_engine` fixture"
        )

    @pytest.fixture
    def make_trainer(self, model: ResolvedModel) -> MakeTrainer:
        from plait.api import build, get_registry

        try:
            get_registry().get("trainer_engine", self.reference_trainer)
        except UnknownComponentError:
            pytest.skip(f"reference trainer engine {self.reference_trainer!r} is not installed")
        return lambda: build("trainer_engine", self.reference_trainer, model, seed=0)

    @pytest.fixture
    def vocab(self, model: ResolvedModel) -> int:
        return vocab_size(model)

    @pytest.fixture
    def tokenizer(self, model: ResolvedModel) -> Any:
        from plait_hf.chat_template import load_tokenizer

        return load_tokenizer(model.tokenizer_path)

    # -- helpers ----------------------------------------------------------------------------------

    def run(
        self, make_engine: MakeEngine, body: Callable[[InferenceEngine], Awaitable[Any]]
    ) -> Any:
        return run_with(make_engine, body, self.timeout_s)

    def prompt(self, vocab: int, seed: int = 0, length: int | None = None) -> ModelInput:
        return ModelInput.from_ints(random_tokens(seed, length or self.prompt_len, vocab))

    def reference_logprobs(
        self, trainer: TrainerEngine, prompt: ModelInput, tokens: Sequence[int]
    ) -> np.ndarray:
        """The trainer's logprobs of `tokens` as a continuation of `prompt`."""
        out = trainer.forward([sft_datum(prompt.to_ints() + list(tokens))])
        return datum_logprobs(out)[0][-len(tokens) :]

    def check_sequence(self, seq: SampledSequence, vocab: int, version: int) -> None:
        assert len(seq.tokens) == len(seq.logprobs) == len(seq.versions())
        assert all(0 <= t < vocab for t in seq.tokens)
        assert all(np.isfinite(lp) and lp <= 1e-6 for lp in seq.logprobs), seq.logprobs
        assert seq.versions() == (version,) * len(seq.tokens)
        assert seq.weight_version == version

    # -- basics -----------------------------------------------------------------------------------

    def test_implements_the_protocol(self, make_engine: MakeEngine) -> None:
        async def body(engine: InferenceEngine) -> None:
            assert isinstance(engine, InferenceEngine)
            assert engine.weight_version == 0
            health = await engine.health()
            assert health.ok and health.weight_version == 0

        self.run(make_engine, body)

    def test_counts_lengths_and_stop_reasons(self, make_engine: MakeEngine, vocab: int) -> None:
        async def body(engine: InferenceEngine) -> None:
            response = await engine.sample(
                self.prompt(vocab), 3, SamplingParams(max_tokens=6, stop=[], seed=0)
            )
            assert len(response.sequences) == 3
            for seq in response.sequences:
                assert len(seq.tokens) == 6 and seq.stop_reason == "length"
                self.check_sequence(seq, vocab, 0)
            one = await engine.sample(self.prompt(vocab), 1, SamplingParams(max_tokens=1, stop=[]))
            assert len(one.sequences[0].tokens) == 1 and one.sequences[0].stop_reason == "length"

        self.run(make_engine, body)

    def test_concurrent_requests_all_complete(self, make_engine: MakeEngine, vocab: int) -> None:
        shapes = [(1, 3), (2, 5), (4, 2), (1, 8), (3, 4)]  # (n, max_tokens)

        async def body(engine: InferenceEngine) -> None:
            responses = await asyncio.gather(
                *[
                    engine.sample(
                        self.prompt(vocab, seed=i, length=3 + 2 * i),
                        n,
                        SamplingParams(max_tokens=m, stop=[]),
                    )
                    for i, (n, m) in enumerate(shapes)
                ]
            )
            for (n, m), response in zip(shapes, responses, strict=True):
                assert [len(s.tokens) for s in response.sequences] == [m] * n

        self.run(make_engine, body)

    # -- seeds ------------------------------------------------------------------------------------

    def test_seeds_reproduce_and_samples_differ(self, make_engine: MakeEngine, vocab: int) -> None:
        params = SamplingParams(max_tokens=8, stop=[], seed=1234)

        async def body(engine: InferenceEngine) -> None:
            first = await engine.sample(self.prompt(vocab), 4, params)
            again = await engine.sample(self.prompt(vocab), 4, params)
            other = await engine.sample(
                self.prompt(vocab), 4, SamplingParams(max_tokens=8, stop=[], seed=99)
            )
            tokens = [s.tokens for s in first.sequences]
            assert tokens == [s.tokens for s in again.sequences], (
                "same seed and weights must give the same tokens"
            )
            assert len(set(tokens)) > 1, "the n samples of one request must not all be the same"
            assert tokens != [s.tokens for s in other.sequences], (
                "different seeds gave the same samples"
            )

        self.run(make_engine, body)

    def test_seeded_samples_do_not_depend_on_the_batch(
        self, make_engine: MakeEngine, vocab: int
    ) -> None:
        params = SamplingParams(max_tokens=6, stop=[], seed=7, temperature=0.9)

        async def body(engine: InferenceEngine) -> None:
            alone = await engine.sample(self.prompt(vocab), 2, params)
            crowd = await asyncio.gather(
                engine.sample(
                    self.prompt(vocab, seed=1, length=15), 3, SamplingParams(max_tokens=9, stop=[])
                ),
                engine.sample(self.prompt(vocab), 2, params),
                engine.sample(
                    self.prompt(vocab, seed=2, length=2),
                    1,
                    SamplingParams(max_tokens=3, stop=[], top_k=5),
                ),
            )
            shared = crowd[1]
            assert [s.tokens for s in alone.sequences] == [s.tokens for s in shared.sequences]
            for a, b in zip(alone.sequences, shared.sequences, strict=True):
                np.testing.assert_allclose(a.logprobs, b.logprobs, atol=self.logprob_atol)

        self.run(make_engine, body)

    def test_greedy_is_deterministic_and_equals_top_k_1(
        self, make_engine: MakeEngine, vocab: int
    ) -> None:
        async def body(engine: InferenceEngine) -> None:
            greedy = [
                await engine.sample(
                    self.prompt(vocab),
                    1,
                    SamplingParams(max_tokens=6, stop=[], temperature=0, seed=s),
                )
                for s in (1, 2)
            ]
            top1 = await engine.sample(
                self.prompt(vocab), 2, SamplingParams(max_tokens=6, stop=[], top_k=1)
            )
            assert greedy[0].sequences[0].tokens == greedy[1].sequences[0].tokens
            assert all(s.tokens == greedy[0].sequences[0].tokens for s in top1.sequences)

        self.run(make_engine, body)

    # -- logprobs ---------------------------------------------------------------------------------

    def test_logprobs_match_the_trainer(
        self, make_engine: MakeEngine, make_trainer: MakeTrainer, vocab: int
    ) -> None:
        """Logprobs come from the raw distribution (temperature 1, unfiltered), as the trainer sees
        it."""
        trainer = make_trainer()
        prompt = self.prompt(vocab)

        async def body(engine: InferenceEngine) -> list[SampledSequence]:
            response = await engine.sample(
                prompt,
                2,
                SamplingParams(max_tokens=8, stop=[], seed=3, temperature=0.7, top_k=20, top_p=0.9),
            )
            return list(response.sequences)

        try:
            for seq in self.run(make_engine, body):
                np.testing.assert_allclose(
                    seq.logprobs,
                    self.reference_logprobs(trainer, prompt, seq.tokens),
                    atol=self.logprob_atol,
                )
        finally:
            trainer.close()

    def test_compute_logprobs_matches_the_trainer(
        self, make_engine: MakeEngine, make_trainer: MakeTrainer, vocab: int
    ) -> None:
        prompt = self.prompt(vocab, length=10)
        values = self.run(make_engine, lambda engine: engine.compute_logprobs(prompt))
        assert len(values) == prompt.length and values[0] is None
        trainer = make_trainer()
        try:
            expected = datum_logprobs(trainer.forward([sft_datum(prompt.to_ints())]))[0]
        finally:
            trainer.close()
        np.testing.assert_allclose(values[1:], expected, atol=self.logprob_atol)

    # -- stops ------------------------------------------------------------------------------------

    def test_stop_token_ends_the_sequence_and_is_returned(
        self, make_engine: MakeEngine, vocab: int
    ) -> None:
        # Seeded sampling repeats itself, so the run with a stop token follows the free run
        # until the stop token appears.
        params = SamplingParams(max_tokens=8, stop=[], seed=21)

        async def body(engine: InferenceEngine) -> None:
            free = (await engine.sample(self.prompt(vocab), 1, params)).sequences[0].tokens
            k = next((i for i in range(1, len(free)) if free[i] not in free[:i]), None)
            if k is None:
                pytest.skip("the free run repeats one token; no distinct stop token to test with")
            stopped = (
                await engine.sample(self.prompt(vocab), 1, attrs.evolve(params, stop=[free[k]]))
            ).sequences[0]
            assert stopped.tokens == free[: k + 1] and stopped.stop_reason == "stop"

        self.run(make_engine, body)

    def test_stop_string_ends_the_sequence(
        self, make_engine: MakeEngine, vocab: int, tokenizer: Any
    ) -> None:
        params = SamplingParams(max_tokens=24, stop=[], seed=22)

        async def body(engine: InferenceEngine) -> None:
            free = (await engine.sample(self.prompt(vocab), 1, params)).sequences[0].tokens
            for k in range(1, len(free)):
                piece = tokenizer.decode([free[k]]).strip()
                if (
                    piece.isascii()
                    and piece.isalnum()
                    and piece not in tokenizer.decode(list(free[:k]))
                    and piece in tokenizer.decode(list(free[: k + 1]))
                ):
                    break
            else:
                pytest.skip(
                    "no sampled token decodes to a plain ASCII word to use as a stop string"
                )
            stopped = (
                await engine.sample(self.prompt(vocab), 1, attrs.evolve(params, stop=[piece]))
            ).sequences[0]
            assert stopped.stop_reason == "stop"
            assert stopped.tokens == free[: k + 1], (
                f"stop string {piece!r} should end the sequence at token {k}"
            )

        self.run(make_engine, body)

    # -- weights ----------------------------------------------------------------------------------

    def train_towards(
        self, trainer: TrainerEngine, prompt: ModelInput, target: int, steps: int = 3
    ) -> WeightUpdate:
        """Train the trainer to continue `prompt` with `target`; the update that carries it over."""
        datum = sft_datum([*prompt.to_ints(), target], [0.0] * (prompt.length - 1) + [1.0])
        for _ in range(steps):
            trainer.forward_backward([datum], "cross_entropy")
            trainer.optim_step(AdamParams(learning_rate=1e-1))
        return WeightUpdate(version=trainer.weight_version, tensors=dict(trainer.export_weights()))

    def test_apply_weights_changes_samples_and_versions(
        self, make_engine: MakeEngine, make_trainer: MakeTrainer, vocab: int
    ) -> None:
        if not self.takes_weight_updates:
            self.check_weight_updates_refused(make_engine)
            return
        trainer = make_trainer()
        prompt = self.prompt(vocab)
        target = (prompt.to_ints()[-1] + 17) % vocab

        async def body(
            engine: InferenceEngine,
        ) -> tuple[list[SampledSequence], list[SampledSequence]]:
            params = SamplingParams(max_tokens=5, stop=[], seed=11)
            before = list((await engine.sample(prompt, 2, params)).sequences)
            update = self.train_towards(trainer, prompt, target)
            await engine.apply_weights(update)
            assert engine.weight_version == update.version
            assert (await engine.health()).weight_version == update.version
            after = list((await engine.sample(prompt, 2, params)).sequences)
            greedy = (
                await engine.sample(prompt, 1, SamplingParams(max_tokens=1, stop=[], temperature=0))
            ).sequences[0]
            assert greedy.tokens == (target,), (
                "after the update, greedy decoding must follow the trained weights"
            )
            return before, after

        try:
            before, after = self.run(make_engine, body)
            for seq in after:
                self.check_sequence(seq, vocab, trainer.weight_version)
                np.testing.assert_allclose(
                    seq.logprobs,
                    self.reference_logprobs(trainer, prompt, seq.tokens),
                    atol=self.logprob_atol,
                )
            assert [s.tokens for s in before] != [s.tokens for s in after] or any(
                np.abs(np.subtract(a.logprobs, b.logprobs)).max() > 10 * self.logprob_atol
                for a, b in zip(before, after, strict=True)
            ), "the weight update changed nothing"
        finally:
            trainer.close()

    def test_default_stop_is_end_of_sequence(
        self, make_engine: MakeEngine, make_trainer: MakeTrainer, vocab: int, tokenizer: Any
    ) -> None:
        eos = tokenizer.eos_token_id
        if eos is None or not self.takes_weight_updates:
            pytest.skip(
                "the test trains the model towards end-of-sequence, "
                "which needs eos and weight updates"
            )
        trainer = make_trainer()
        prompt = self.prompt(vocab)

        async def body(engine: InferenceEngine) -> None:
            await engine.apply_weights(self.train_towards(trainer, prompt, eos))
            greedy = SamplingParams(max_tokens=4, temperature=0)
            stopped = (await engine.sample(prompt, 1, greedy)).sequences[0]
            assert stopped.tokens == (eos,) and stopped.stop_reason == "stop", (
                "stop=None must stop at eos"
            )
            free = (await engine.sample(prompt, 1, attrs.evolve(greedy, stop=[]))).sequences[0]
            assert (
                free.tokens[0] == eos and len(free.tokens) == 4 and free.stop_reason == "length"
            ), "stop=[] must not stop at eos"

        try:
            self.run(make_engine, body)
        finally:
            trainer.close()

    # -- pause / resume ---------------------------------------------------------------------------

    async def start_long_request(
        self, engine: InferenceEngine, vocab: int, max_tokens: int, settle: bool = False
    ) -> asyncio.Task[Any]:
        """A long request that is certainly in flight when this returns: one-token requests sent
        after it (`in_flight_probes`) have completed, so the batch they share has produced its
        first tokens; with `settle`, also `settle_probe_round_trips` later."""
        long = asyncio.ensure_future(
            engine.sample(
                self.prompt(vocab), 1, SamplingParams(max_tokens=max_tokens, stop=[], seed=5)
            )
        )
        slowest = 0.0
        for _ in range(self.in_flight_probes):
            sent = time.monotonic()
            await engine.sample(
                self.prompt(vocab, seed=1), 1, SamplingParams(max_tokens=1, stop=[])
            )
            slowest = max(slowest, time.monotonic() - sent)
        await asyncio.sleep(self.settle_probe_round_trips * slowest if settle else 0)
        return long

    def check_weight_updates_refused(self, make_engine: MakeEngine) -> None:
        async def body(engine: InferenceEngine) -> None:
            with pytest.raises(PlaitError) as info:
                await engine.apply_weights(WeightUpdate(version=1, tensors={}))
            assert info.value.fix, "the error must say what to do instead"
            assert engine.weight_version == 0 and (await engine.health()).ok

        self.run(make_engine, body)

    def test_pause_keep_holds_requests_and_resumes_with_new_weights(
        self, make_engine: MakeEngine, make_trainer: MakeTrainer, vocab: int
    ) -> None:
        trainer = make_trainer()
        new = 1 if self.takes_weight_updates else 0  # the version after the pause

        async def body(engine: InferenceEngine) -> None:
            # long enough to be mid-stream at the pause even on a fast server (48 tokens once
            # finished between the probes and the pause on vLLM CPU)
            tokens = self.keep_request_tokens
            long = await self.start_long_request(engine, vocab, max_tokens=tokens)
            await engine.pause("keep")
            assert not long.done(), "pause('keep') must hold in-flight requests"
            held = asyncio.ensure_future(
                engine.sample(self.prompt(vocab, seed=2), 1, SamplingParams(max_tokens=2, stop=[]))
            )
            if self.takes_weight_updates:
                await engine.apply_weights(
                    self.train_towards(trainer, self.prompt(vocab, seed=3), 5, steps=1)
                )
            await asyncio.sleep(0.2)
            assert not long.done() and not held.done(), "nothing may run while paused"
            await engine.resume()
            seq = (await long).sequences[0]
            assert len(seq.tokens) == tokens and seq.stop_reason == "length"
            versions = seq.versions()
            assert (
                versions[0] == 0 and versions[-1] == new and list(versions) == sorted(versions)
            ), f"tokens before the pause carry version 0, after it version {new}: {versions}"
            assert seq.weight_version == new
            assert (await held).sequences[0].versions() == (new, new)

        try:
            self.run(make_engine, body)
        finally:
            trainer.close()

    def test_pause_abort_returns_what_requests_have(
        self, make_engine: MakeEngine, vocab: int
    ) -> None:
        async def body(engine: InferenceEngine) -> None:
            tokens = self.abort_request_tokens
            for _ in range(3):  # a loaded machine may finish the request before the pause lands
                long = await self.start_long_request(engine, vocab, max_tokens=tokens, settle=True)
                await engine.pause("abort")
                seq = (await long).sequences[0]
                if seq.stop_reason != "length":
                    break
                await engine.resume()  # outran: the pause found nothing running; again
            assert seq.stop_reason == "abort" and 1 <= len(seq.tokens) < tokens, (
                seq.stop_reason,
                len(seq.tokens),
            )
            self.check_sequence(seq, vocab, 0)
            later = asyncio.ensure_future(
                engine.sample(self.prompt(vocab), 1, SamplingParams(max_tokens=3, stop=[]))
            )
            await asyncio.sleep(0.2)
            assert not later.done(), "a request sent while paused must wait for resume()"
            await engine.resume()
            assert len((await later).sequences[0].tokens) == 3

        self.run(make_engine, body)

    def test_pause_wait_lets_requests_finish(self, make_engine: MakeEngine, vocab: int) -> None:
        async def body(engine: InferenceEngine) -> None:
            long = await self.start_long_request(engine, vocab, max_tokens=24)
            await engine.pause("wait")
            # Finished while the engine stays paused (no resume yet): neither held nor aborted.
            seq = (await asyncio.wait_for(long, 30)).sequences[0]
            assert len(seq.tokens) == 24 and seq.stop_reason == "length"
            await engine.resume()
            assert (
                len(
                    (
                        await engine.sample(
                            self.prompt(vocab), 1, SamplingParams(max_tokens=2, stop=[])
                        )
                    )
                    .sequences[0]
                    .tokens
                )
                == 2
            )

        self.run(make_engine, body)

    # -- bad input --------------------------------------------------------------------------------

    def test_bad_requests_are_clear_errors(self, make_engine: MakeEngine, vocab: int) -> None:
        async def body(engine: InferenceEngine) -> None:
            with pytest.raises((PlaitError, ValueError), match=r"(?i)empty"):
                await engine.sample(ModelInput.empty(), 1, SamplingParams(max_tokens=2))
            with pytest.raises((PlaitError, ValueError), match=str(vocab + 3)):
                await engine.sample(
                    ModelInput.from_ints([1, vocab + 3]), 1, SamplingParams(max_tokens=2)
                )
            with pytest.raises((PlaitError, ValueError)):
                await engine.sample(self.prompt(vocab), 0, SamplingParams(max_tokens=2))
            # the engine still works afterwards
            assert (
                len(
                    (
                        await engine.sample(
                            self.prompt(vocab), 1, SamplingParams(max_tokens=2, stop=[])
                        )
                    ).sequences
                )
                == 1
            )

        self.run(make_engine, body)
