"""plait-torch honours SamplingParams.grammar: a renderer's tool-call grammar (tool_choice
"required" / a named tool) makes even the random tiny-qwen3 write calls to the offered tools."""

from __future__ import annotations

import pytest

from plait.api import DataError, ResolvedModel, SamplingParams
from plait_hf.chat_template import ChatTemplateRenderer
from plait_testing.inference import run_with
from plait_testing.tool_calls import TOOLS, assert_valid_calls, tool_prompt
from plait_torch.inference import TorchInferenceEngine


@pytest.fixture(scope="module")
def renderer(tiny_model: ResolvedModel) -> ChatTemplateRenderer:
    return ChatTemplateRenderer.from_model(tiny_model)


@pytest.mark.parametrize(
    "parallel",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # 14 s: with the slow tests
)
def test_required_tool_choice_yields_valid_calls_on_every_seed(
    tiny_model: ResolvedModel, renderer: ChatTemplateRenderer, parallel: bool
) -> None:
    grammar = renderer.tool_call_grammar(TOOLS, parallel=parallel)
    params = [
        SamplingParams(max_tokens=400, seed=seed, grammar=grammar, stop=renderer.stop_sequences())
        for seed in range(2)
    ]

    async def body(engine: TorchInferenceEngine) -> list:
        return [await engine.sample(tool_prompt(renderer), 2, p) for p in params]

    responses = run_with(lambda: TorchInferenceEngine(tiny_model), body)
    sequences = [s for r in responses for s in r.sequences]
    calls = assert_valid_calls(renderer, sequences)
    if not parallel:
        assert len(calls) == len(sequences)
    # the constraint is all that makes these calls: unconstrained, the random model writes noise
    assert {call.name for call in calls} <= {tool.name for tool in TOOLS}


def test_a_named_tool_is_the_only_one_called(
    tiny_model: ResolvedModel, renderer: ChatTemplateRenderer
) -> None:
    search = [t for t in TOOLS if t.name == "search"]
    params = SamplingParams(
        max_tokens=400, seed=7, grammar=renderer.tool_call_grammar(search, parallel=False)
    )
    response = run_with(
        lambda: TorchInferenceEngine(tiny_model),
        lambda e: e.sample(tool_prompt(renderer), 4, params),
    )
    calls = assert_valid_calls(renderer, response.sequences, search)
    assert {call.name for call in calls} == {"search"}


def test_logprobs_stay_the_raw_models(
    tiny_model: ResolvedModel, renderer: ChatTemplateRenderer
) -> None:
    grammar = renderer.tool_call_grammar(TOOLS, parallel=False)

    async def body(engine: TorchInferenceEngine) -> tuple:
        sampled = await engine.sample(
            tool_prompt(renderer), 1, SamplingParams(max_tokens=400, seed=3, grammar=grammar)
        )
        sequence = sampled.sequences[0]
        scored = await engine.compute_logprobs(tool_prompt(renderer).append_ints(sequence.tokens))
        return sequence, scored

    sequence, scored = run_with(lambda: TorchInferenceEngine(tiny_model), body)
    tail = scored[-len(sequence.tokens) :]
    assert sequence.logprobs == pytest.approx(tail, abs=1e-4)


def test_grammar_complete_without_stop_tokens_ends_the_sequence(
    tiny_model: ResolvedModel, renderer: ChatTemplateRenderer
) -> None:
    params = SamplingParams(max_tokens=50, seed=0, stop=[], grammar='root ::= "yes" | "no"')
    response = run_with(
        lambda: TorchInferenceEngine(tiny_model),
        lambda e: e.sample(tool_prompt(renderer), 3, params),
    )
    for sequence in response.sequences:
        assert sequence.stop_reason == "stop"
        assert renderer.tokenizer.decode(sequence.tokens) in ("yes", "no")


def test_a_grammar_that_does_not_compile_is_a_data_error(tiny_model: ResolvedModel) -> None:
    params = SamplingParams(max_tokens=5, grammar="root ::= missing_rule")
    with pytest.raises(DataError, match="missing_rule"):
        run_with(
            lambda: TorchInferenceEngine(tiny_model),
            lambda e: e.sample(tool_prompt_ids(), 1, params),
        )


def tool_prompt_ids():
    from plait.api import ModelInput

    return ModelInput.from_ints([1, 2, 3])
