"""SamplingParams.grammar reaches vLLM's structured outputs (`structured_outputs.grammar`,
compiled by xgrammar): a real vLLM CPU server constrains the random tiny-qwen3 to valid calls."""

from __future__ import annotations

import pytest

from plait.api import EngineError, ModelInput, ResolvedModel, SamplingParams
from plait_hf.chat_template import ChatTemplateRenderer
from plait_testing.inference import run_with
from plait_testing.tool_calls import TOOLS, assert_valid_calls, tool_prompt

pytestmark = pytest.mark.vllm


def test_required_tool_choice_yields_valid_calls_on_every_seed(
    make_attached, tiny_model: ResolvedModel
) -> None:
    renderer = ChatTemplateRenderer.from_model(tiny_model)
    grammar = renderer.tool_call_grammar(TOOLS, parallel=False)

    async def body(engine) -> list:
        return [
            await engine.sample(
                tool_prompt(renderer), 2, SamplingParams(max_tokens=400, seed=s, grammar=grammar)
            )
            for s in range(3)
        ]

    responses = run_with(make_attached, body)
    sequences = [s for r in responses for s in r.sequences]
    assert len(assert_valid_calls(renderer, sequences)) == len(sequences)


def test_a_grammar_vllm_cannot_compile_is_refused(make_attached) -> None:
    params = SamplingParams(max_tokens=4, grammar="root ::= nowhere")
    with pytest.raises(EngineError):
        run_with(make_attached, lambda e: e.sample(ModelInput.from_ints([1, 2, 3]), 1, params))
