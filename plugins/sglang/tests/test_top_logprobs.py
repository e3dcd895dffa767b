"""SamplingParams.top_logprobs goes to SGLang as `top_logprobs_num` and comes back from
`meta_info.output_top_logprobs`; the fake server computes them as SGLang does (the wire-fidelity
test checks the request against SGLang's own contract)."""

from __future__ import annotations

from plait_testing.inference import assert_greedy_top_logprobs


def test_each_sampled_token_comes_with_the_k_most_likely(make_attached) -> None:
    assert_greedy_top_logprobs(make_attached)
