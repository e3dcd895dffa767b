"""SamplingParams.top_logprobs from a real vLLM CPU server: each sampled token's k most likely
tokens, the greedy choice first."""

from __future__ import annotations

import pytest

from plait.api import ModelInput, SamplingParams
from plait_testing.inference import run_with

pytestmark = pytest.mark.vllm


def test_each_sampled_token_comes_with_the_k_most_likely(make_attached) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, stop=[], top_logprobs=3)
    response = run_with(
        make_attached, lambda e: e.sample(ModelInput.from_ints([1, 2, 3]), 1, params)
    )
    sequence = response.sequences[0]
    assert sequence.top_logprobs is not None and len(sequence.top_logprobs) == 5
    for token, logprob, top in zip(
        sequence.tokens, sequence.logprobs, sequence.top_logprobs, strict=True
    ):
        assert len(top) == 3 and top[0][0] == token and top[0][1] == pytest.approx(logprob)
        assert top[0][1] >= top[1][1] >= top[2][1]
