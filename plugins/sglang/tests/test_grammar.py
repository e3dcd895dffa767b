"""SamplingParams.grammar goes to SGLang as the `ebnf` sampling param; the fake server honours it
as SGLang's grammar backend does (tools and checks: plait_testing.tool_calls)."""

from __future__ import annotations

import httpx
import pytest

from plait.api import EngineError, ResolvedModel, SamplingParams
from plait_hf.chat_template import ChatTemplateRenderer
from plait_testing.inference import run_with
from plait_testing.tool_calls import assert_one_valid_call_per_sample


@pytest.mark.slow  # 14 s of sampling on the fake server: with the slow tests
def test_required_tool_choice_yields_valid_calls_on_every_seed(
    make_attached, tiny_model: ResolvedModel
) -> None:
    assert_one_valid_call_per_sample(make_attached, ChatTemplateRenderer.from_model(tiny_model))


def test_a_grammar_sglang_cannot_compile_is_a_400(make_attached, fake_server) -> None:
    with pytest.raises(EngineError, match="Failed to compile ebnf grammar"):
        run_with(
            make_attached,
            lambda e: e.sample(
                tool_prompt_ids(), 1, SamplingParams(max_tokens=4, grammar="root ::= nowhere")
            ),
        )
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 2, "ebnf": 'root ::= "a"', "regex": "a"},
    }
    reply = httpx.post(f"{fake_server.base_url}/generate", json=body, timeout=60)
    assert reply.status_code == 400
    assert "Only one of json_schema, regex, ebnf, or structural_tag" in reply.text


def tool_prompt_ids():
    from plait.api import ModelInput

    return ModelInput.from_ints([1, 2, 3])
