"""SamplingParams.grammar reaches vLLM's structured outputs (`structured_outputs.grammar`,
compiled by xgrammar): a real vLLM CPU server constrains the random tiny-qwen3 to valid calls."""

from __future__ import annotations

import pytest

from plait.api import EngineError, ModelInput, ResolvedModel, SamplingParams
from plait_hf.chat_template import ChatTemplateRenderer
from plait_testing.inference import run_with
from plait_testing.tool_calls import assert_one_valid_call_per_sample

pytestmark = pytest.mark.vllm


def test_required_tool_choice_yields_valid_calls_on_every_seed(
    make_attached, tiny_model: ResolvedModel
) -> None:
    assert_one_valid_call_per_sample(make_attached, ChatTemplateRenderer.from_model(tiny_model))


def test_a_grammar_vllm_cannot_compile_is_refused(make_attached) -> None:
    params = SamplingParams(max_tokens=4, grammar="root ::= nowhere")
    with pytest.raises(EngineError):
        run_with(make_attached, lambda e: e.sample(ModelInput.from_ints([1, 2, 3]), 1, params))
