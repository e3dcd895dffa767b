"""The chat template of examples/calculator_smollm2.toml (ChatML with JSON tool calls, for a model
whose own template writes no tools) keeps the renderer contract: tools shown, tool calls written
and parsed back, supervised examples that extend the generation prompt. Checked on the Qwen3
tokenizer, which has the ChatML tokens SmolLM2's has (the SmolLM2 run itself is the example's,
measured in benchmarks/algorithms.py)."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

import pytest

from plait.api import Message, ToolCall, ToolSpec
from plait_hf.chat_template import ChatTemplateOptions, ChatTemplateRenderer
from plait_testing.renderer import RendererContract, qwen3_tokenizer

EXAMPLE = Path(__file__).parents[1] / "examples" / "calculator_smollm2.toml"


def example_renderer() -> ChatTemplateRenderer:
    options = tomllib.loads(EXAMPLE.read_text())["renderer"]["options"]
    return ChatTemplateRenderer(copy.deepcopy(qwen3_tokenizer()), ChatTemplateOptions(**options))


class TestCalculatorExampleTemplate(RendererContract):
    reasons = False

    @pytest.fixture
    def renderer(self) -> ChatTemplateRenderer:
        return example_renderer()


def test_the_model_sees_the_tools_and_its_json_call_is_parsed():
    renderer = example_renderer()
    assert renderer.tool_call_format == "json"
    calculator = ToolSpec(
        "calculator",
        "Evaluate an arithmetic expression.",
        {"type": "object", "properties": {"expression": {"type": "string"}}},
    )
    prompt = renderer.build_generation_prompt(
        [Message("user", "Compute 2 * 3.")], tools=[calculator]
    )
    text = renderer.tokenizer.decode(prompt.to_ints())
    assert 'calculator: Evaluate an arithmetic expression. Arguments: {"expression"' in text
    sampled = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>'
    )
    ids = renderer.tokenizer.encode(sampled + "<|im_end|>", add_special_tokens=False)
    message, termination = renderer.parse_response(ids)
    assert termination.is_clean
    assert message.tool_calls == (ToolCall("calculator", {"expression": "2 * 3"}),)
