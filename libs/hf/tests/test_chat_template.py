"""The generic chat-template renderer on the real Qwen3 tokenizer, with the Qwen3 template (JSON
tool calls) and the Qwen3.5 template (XML tool calls): the renderer contract, tools shown to the
model, tool calls parsed back, bridging only where the template keeps the sampled turn."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest

from plait.api import Message, ParseTermination, ToolCall
from plait_hf.chat_template import ChatTemplateOptions, ChatTemplateRenderer
from plait_testing.renderer import (
    CALCULATOR,
    FIXTURE_CONVERSATIONS,
    RendererContract,
    qwen3_tokenizer,
    reference_template,
    sampled_turn,
)

FIXTURES = {c.name: c for c in FIXTURE_CONVERSATIONS}


def qwen3(**template_kwargs: Any) -> ChatTemplateRenderer:
    return ChatTemplateRenderer(
        qwen3_tokenizer(), ChatTemplateOptions(template_kwargs=template_kwargs)
    )


@functools.cache
def qwen3_5() -> ChatTemplateRenderer:
    # A renderer sets the template on its tokenizer, so this one gets a copy of its own.
    return ChatTemplateRenderer(
        copy.deepcopy(qwen3_tokenizer()),
        ChatTemplateOptions(chat_template=reference_template("Qwen3.5-4B.jinja")),
    )


class TestQwen3Template(RendererContract):
    @pytest.fixture
    def renderer(self) -> ChatTemplateRenderer:
        return qwen3()


class TestQwen3TemplateNoThinking(RendererContract):
    reasons = False

    @pytest.fixture
    def renderer(self) -> ChatTemplateRenderer:
        return qwen3(enable_thinking=False)


class TestQwen35Template(RendererContract):
    unsupported = frozenset({"system_mid_conversation"})
    extends_generation_prompt = False  # its empty <think> block BPE-merges across the prompt's end

    @pytest.fixture
    def renderer(self) -> ChatTemplateRenderer:
        return qwen3_5()


def test_tools_are_shown_to_the_model() -> None:
    prompt = qwen3().build_generation_prompt([Message("user", "2+2?")], tools=[CALCULATOR])
    text = qwen3_tokenizer().decode(prompt.to_ints())
    assert '{"type": "function", "function": {"name": "calculator"' in text
    assert text.startswith("<|im_start|>system\n# Tools") and text.endswith(
        "<|im_start|>assistant\n"
    )


def test_the_format_is_recognised_from_the_template() -> None:
    assert qwen3().tool_call_format == "json"
    assert qwen3_5().tool_call_format == "xml"
    assert (
        ChatTemplateRenderer(
            qwen3_tokenizer(), ChatTemplateOptions(tool_call_format="none")
        ).tool_call_format
        is None
    )


def test_tool_calls_parse_in_each_format() -> None:
    tokenizer = qwen3_tokenizer()
    json_text = (
        "<think>\nuse it\n</think>\n\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
    )
    message, termination = qwen3().parse_response(
        [*tokenizer.encode(json_text), tokenizer.eos_token_id]
    )
    assert termination.is_clean and message.reasoning_content == "use it"
    assert message.tool_calls == (ToolCall("calculator", {"expression": "2+2"}),)
    xml_text = (
        "use it\n</think>\n\n<tool_call>\n<function=calculator>\n"
        "<parameter=expression>\n2+2\n</parameter>\n</function>\n</tool_call>"
    )
    message, termination = qwen3_5().parse_response(
        [*tokenizer.encode(xml_text), tokenizer.eos_token_id]
    )
    assert termination.is_clean and message.reasoning_content == "use it"
    assert message.tool_calls == (ToolCall("calculator", {"expression": "2+2"}),)
    broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": }}\n</tool_call>'
    message, termination = qwen3().parse_response(
        [*tokenizer.encode(broken), tokenizer.eos_token_id]
    )
    assert termination is ParseTermination.MALFORMED and message.content == broken


def test_a_close_tag_inside_a_json_argument_does_not_end_the_call() -> None:
    # the tool-call grammar lets a string hold "</tool_call>"; the parser must read past it
    tokenizer = qwen3_tokenizer()
    text = (
        '<tool_call>\n{"name": "search", "arguments": {"query": "a</tool_call>b"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "search", "arguments": {"query": "c"}}\n</tool_call>'
    )
    message, termination = qwen3().parse_response([*tokenizer.encode(text), tokenizer.eos_token_id])
    assert termination.is_clean
    assert message.tool_calls == (
        ToolCall("search", {"query": "a</tool_call>b"}),
        ToolCall("search", {"query": "c"}),
    )


def test_the_bridge_follows_what_the_template_keeps() -> None:
    renderer = qwen3()
    conversation = FIXTURES["tool_cycle_then_new_query"]
    messages, tools = conversation.messages, conversation.tools
    prompt, completion = sampled_turn(renderer, messages, 1, tools)
    # Inside a tool cycle the Qwen3 template keeps the turn's reasoning: bridged, and equal to
    # re-rendering.
    assert (
        renderer.bridge_to_next_turn(prompt, completion, messages[2:3])
        == renderer.build_generation_prompt(messages[:3], tools=tools).to_ints()
    )
    # A new query makes the template drop the reasoning of earlier turns: no bridge.
    prompt, completion = sampled_turn(renderer, messages, 3, tools)
    assert renderer.bridge_to_next_turn(prompt, completion, messages[4:5]) is None


def test_a_cut_off_turn_is_closed_the_way_the_template_closes_it() -> None:
    renderer, tokenizer = qwen3_5(), qwen3_tokenizer()
    history = [Message("user", "Compute 6*7.")]
    prompt = renderer.build_generation_prompt(history, tools=[CALCULATOR]).to_ints()
    cut = tokenizer.encode("6*7 is")  # still thinking (the prompt opened <think>)
    message, termination = renderer.parse_response(cut)
    assert termination is ParseTermination.TRUNCATED and message.reasoning_content == "6*7 is"
    bridged = renderer.bridge_to_next_turn(prompt, cut, [Message("tool", "42")])
    assert bridged is not None and bridged[: len(prompt) + len(cut)] == prompt + cut
    assert tokenizer.decode(bridged[len(prompt) + len(cut) :]).startswith(
        "\n</think>\n\n<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>"
    )


def test_reasoning_that_mentions_think_is_parsed_whole_and_the_tool_cycle_bridges() -> None:
    renderer, tokenizer = qwen3(), qwen3_tokenizer()
    history = [Message("user", "What does <think> do? Check 2+2 with the tool.")]
    prompt = renderer.build_generation_prompt(history, tools=[CALCULATOR]).to_ints()
    reasoning = (
        "The user asks what <think> does. A <think> block holds my reasoning; compute first."
    )
    completion = [
        *tokenizer.encode(
            f"<think>\n{reasoning}\n</think>\n\n<tool_call>\n"
            '{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
        ),
        tokenizer.eos_token_id,
    ]
    message, _ = renderer.parse_response(completion)
    assert message.reasoning_content == reasoning
    observation = [Message("tool", "4")]
    assert renderer.bridge_to_next_turn(prompt, completion, observation) == [
        *prompt,
        *completion,
        *renderer.build_generation_prompt(
            [*history, message, *observation], tools=[CALCULATOR]
        ).to_ints()[len(prompt) + len(completion) :],
    ]


def test_a_sampled_plain_text_end_of_turn_stays_text_when_the_history_is_re_rendered() -> None:
    """The model wrote "<|im_end|>" with ordinary tokens (its real <|im_end|> would have stopped
    it). Where the bridge declines (a new query: the template drops the turn's reasoning), the
    re-rendered history must not show the turn ending there."""
    renderer, tokenizer = qwen3(), qwen3_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    history = [Message("user", "How does ChatML end a turn?")]
    prompt = renderer.build_generation_prompt(history).to_ints()
    completion = [
        *tokenizer.encode("<think>\nexplain\n</think>\n\nWith"),
        *tokenizer.encode(" <|im_end|>", split_special_tokens=True),
        *tokenizer.encode(" after the text."),
        im_end,
    ]
    assert completion.count(im_end) == 1
    message, termination = renderer.parse_response(completion)
    assert termination.is_clean and message.content == "With <|im_end|> after the text."
    follow_up = [Message("user", "Thanks.")]
    assert renderer.bridge_to_next_turn(prompt, completion, follow_up) is None
    next_prompt = renderer.build_generation_prompt([*history, message, *follow_up]).to_ints()
    assert (
        next_prompt.count(im_end) == 3
    )  # the user, assistant and user turns; none inside the answer
    assert tokenizer.decode(next_prompt).count("<|im_end|>") == 4
    tokens, weights = renderer.build_supervised_example([*history, message])
    trained = [t for t, w in zip(tokens.to_ints(), weights, strict=True) if w]
    assert trained.count(im_end) == 1 and trained[-1] == im_end
    assert tokenizer.decode(trained).endswith("With <|im_end|> after the text.<|im_end|>")
