"""Checks that a grammar-constrained engine writes tool calls: for every engine's test of
`SamplingParams.grammar` with a renderer's `tool_call_grammar` (tool_choice "required").

The tools' schemas bound every string (`maxLength`, `enum`), so that even a random-weight model,
whose choices among the allowed tokens are noise, finishes a call within a few dozen tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jsonschema

from plait.api import (
    InferenceEngine,
    Message,
    ModelInput,
    SampledSequence,
    SamplingParams,
    ToolCall,
    ToolSpec,
)
from plait_testing.inference import run_with

TOOLS = (
    ToolSpec(
        "get_weather",
        "The weather in a city over the next days.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lagos"]},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days"],
        },
    ),
    ToolSpec(
        "search",
        "Search the notes.",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 12},
                "exact": {"type": "boolean"},
            },
            "required": ["query"],
        },
    ),
)
MESSAGES = (Message("user", "What will the weather be in Oslo tomorrow?"),)


def tool_prompt(renderer: Any, tools: Sequence[ToolSpec] = TOOLS) -> ModelInput:
    return renderer.build_generation_prompt(list(MESSAGES), tools=list(tools))


def assert_valid_calls(
    renderer: Any, sequences: Sequence[SampledSequence], tools: Sequence[ToolSpec] = TOOLS
) -> list[ToolCall]:
    """Every sequence ended on a stop token and parses into at least one call to one of `tools`,
    with arguments that validate against its schema; returns the calls."""
    by_name = {tool.name: tool for tool in tools}
    calls: list[ToolCall] = []
    for sequence in sequences:
        message, termination = renderer.parse_response(sequence.tokens)
        assert sequence.stop_reason == "stop", (sequence.stop_reason, message)
        assert termination.is_clean, (termination, message)
        assert message.tool_calls, message
        assert not message.content.strip(), message
        for call in message.tool_calls:
            assert call.name in by_name, call
            jsonschema.validate(call.arguments, by_name[call.name].input_schema)
            calls.append(call)
    return calls


def assert_one_valid_call_per_sample(
    make_engine: Callable[[], InferenceEngine], renderer: Any, seeds: int = 3
) -> None:
    """Two samples on each of `seeds` seeds under the one-call grammar of TOOLS (tool_choice
    "required"): each is exactly one valid call."""
    grammar = renderer.tool_call_grammar(TOOLS, parallel=False)

    async def body(engine: InferenceEngine) -> list[SampledSequence]:
        sequences: list[SampledSequence] = []
        for seed in range(seeds):
            params = SamplingParams(max_tokens=400, seed=seed, grammar=grammar)
            sequences += (await engine.sample(tool_prompt(renderer), 2, params)).sequences
        return sequences

    sequences = run_with(make_engine, body)
    assert len(assert_valid_calls(renderer, sequences)) == len(sequences)
