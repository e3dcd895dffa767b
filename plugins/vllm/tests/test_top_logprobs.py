"""SamplingParams.top_logprobs from a real vLLM CPU server: each sampled token's k most likely
tokens, the greedy choice first."""

from __future__ import annotations

import pytest

from plait_testing.inference import assert_greedy_top_logprobs

pytestmark = pytest.mark.vllm


def test_each_sampled_token_comes_with_the_k_most_likely(make_attached) -> None:
    assert_greedy_top_logprobs(make_attached)
