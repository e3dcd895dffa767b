"""The extension property, bridging and parsing of the Qwen renderers, on the real Qwen3
tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, find, settings

from plait.api import (
    Message,
    ModelError,
    ParseTermination,
    ResolvedModel,
    SampledSequence,
    ToolCall,
    Turn,
    get_registry,
)
from plait_algorithms.datums import merge_turns
from plait_hf.formats import hf_message, openai_tool
from plait_qwen.chatml import QwenOptions
from plait_qwen.qwen3 import Qwen3InstructRenderer, Qwen3KeepReasoningRenderer, Qwen3Renderer
from plait_qwen.qwen3_5 import Qwen35KeepReasoningRenderer, Qwen35Renderer
from plait_testing.renderer import (
    CALCULATOR,
    FIXTURE_CONVERSATIONS,
    extension_violation,
    qwen3_tokenizer,
    random_conversations,
    sampled_turn,
)

FIXTURES = {c.name: c for c in FIXTURE_CONVERSATIONS}
IM_END = 151645


def fixture(name: str) -> tuple[list[Message], Any]:
    return list(FIXTURES[name].messages), FIXTURES[name].tools


# -- the extension property ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["reasoning_multi_turn", "tool_cycle_empty_reasoning", "tool_cycle_then_new_query"]
)
def test_the_official_qwen3_template_breaks_the_extension_property(
    qwen3_tokenizer: Any, name: str
) -> None:
    messages, tools = fixture(name)
    official = Qwen3Renderer(qwen3_tokenizer)
    assert not official.has_extension_property
    assert "not a prefix" in (extension_violation(official, messages, tools) or "")
    assert extension_violation(Qwen3KeepReasoningRenderer(qwen3_tokenizer), messages, tools) is None


def test_random_conversations_find_official_template_violations(qwen3_tokenizer: Any) -> None:
    official = Qwen3Renderer(qwen3_tokenizer)
    keep = Qwen3KeepReasoningRenderer(qwen3_tokenizer)
    found = find(
        random_conversations(),
        lambda c: extension_violation(official, c.messages, c.tools) is not None,
        settings=settings(max_examples=300, database=None, suppress_health_check=list(HealthCheck)),
    )
    assert extension_violation(keep, found.messages, found.tools) is None
    # The minimal counterexample: a turn sampled after `<|im_start|>assistant\n` starts with a
    # <think> block (the template writes one, if empty, on the turn being answered) that the
    # template no longer shows once another message follows.
    index = next(i for i, m in enumerate(found.messages) if m.role == "assistant")
    prompt, completion = sampled_turn(official, found.messages, index, found.tools)
    later = official.build_supervised_example(found.messages, tools=found.tools)[0].to_ints()
    think = qwen3_tokenizer.convert_tokens_to_ids("<think>")
    assert completion[0] == think and later[len(prompt)] != think


def test_qwen3_5_official_breaks_it_on_an_empty_think_block_the_keep_renderer_does_not(
    qwen3_tokenizer: Any,
) -> None:
    """The `\\n\\n` BPE merge: the prompt ends `<think>` 198, the history writes `<think>` 271."""
    messages = [
        Message("user", "hi"),
        Message("assistant", "hello", reasoning_content=""),
        Message("user", "again"),
        Message("assistant", "yes", reasoning_content=""),
    ]
    assert "does not start with its generation prompt" in extension_violation(
        Qwen35Renderer(qwen3_tokenizer), messages
    )
    keep = Qwen35KeepReasoningRenderer(qwen3_tokenizer)
    assert keep.has_extension_property and extension_violation(keep, messages) is None
    prompt, completion = sampled_turn(keep, messages, 1)
    think = qwen3_tokenizer.convert_tokens_to_ids("<think>")
    assert prompt[-2:] == [think, 198] and completion[:2] == [
        198,
        qwen3_tokenizer.convert_tokens_to_ids("</think>"),
    ]


# -- bridging ------------------------------------------------------------------------------------


def test_official_qwen3_bridges_a_tool_cycle_with_reasoning_and_declines_a_new_query(
    qwen3_tokenizer: Any,
) -> None:
    official = Qwen3Renderer(qwen3_tokenizer)
    messages, tools = fixture("tool_cycle_then_new_query")
    prompt, completion = sampled_turn(official, messages, 1, tools)
    bridged = official.bridge_to_next_turn(prompt, completion, messages[2:3])  # the tool result
    assert bridged == official.build_generation_prompt(messages[:3], tools=tools).to_ints()
    prompt, completion = sampled_turn(official, messages, 3, tools)
    # A new user query: the template now drops the turn's reasoning, so the sampled ids are not
    # what the model would see; the bridge declines and the rollout re-renders.
    assert official.bridge_to_next_turn(prompt, completion, messages[4:5]) is None
    keep = Qwen3KeepReasoningRenderer(qwen3_tokenizer)
    prompt, completion = sampled_turn(keep, messages, 3, tools)
    assert (
        keep.bridge_to_next_turn(prompt, completion, messages[4:5])
        == keep.build_generation_prompt(messages[:5], tools=tools).to_ints()
    )


def test_official_qwen3_declines_when_an_empty_think_block_would_vanish(
    qwen3_tokenizer: Any,
) -> None:
    official = Qwen3Renderer(qwen3_tokenizer)
    messages, tools = fixture("tool_cycle_empty_reasoning")
    prompt, completion = sampled_turn(official, messages, 1, tools)
    assert official.bridge_to_next_turn(prompt, completion, messages[2:3]) is None


def test_official_qwen3_5_bridges_tool_cycles_even_without_reasoning(qwen3_tokenizer: Any) -> None:
    official = Qwen35Renderer(qwen3_tokenizer)
    messages, tools = fixture("tool_cycle_empty_reasoning")
    think, think_end = (qwen3_tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    prompt = official.build_generation_prompt(messages[:1], tools=tools).to_ints()
    # What a sampler writes after `<think>\n` for an empty thought: "\n", "</think>", "\n\n", ...
    completion = [
        198,
        think_end,
        *qwen3_tokenizer.encode(
            "\n\n<tool_call>\n<function=calculator>\n"
            "<parameter=expression>\n11*11\n</parameter>\n"
            "</function>\n</tool_call>"
        ),
        IM_END,
    ]
    assert prompt[-2:] == [think, 198]
    message, termination = official.parse_response(completion)
    assert termination is ParseTermination.STOP_SEQUENCE
    assert (
        message.tool_calls == (ToolCall("calculator", {"expression": "11*11"}),)
        and message.reasoning_content == ""
    )
    bridged = official.bridge_to_next_turn(prompt, completion, messages[2:3])
    assert bridged is not None and bridged[: len(prompt) + len(completion)] == prompt + completion
    rerendered = official.build_generation_prompt(
        [*messages[:1], message, messages[2]], tools=tools
    ).to_ints()
    assert qwen3_tokenizer.decode(bridged) == qwen3_tokenizer.decode(rerendered)
    assert bridged != rerendered  # re-rendering would re-tokenize "\n" + "\n" as one token


REASONING_ABOUT_THINK = (
    "The user asks what <think> does. A <think> block holds my reasoning; compute first."
)


def test_reasoning_that_mentions_think_is_parsed_whole_and_the_tool_cycle_bridges(
    qwen3_tokenizer: Any,
) -> None:
    """The reasoning runs from the block's opening `<think>` to `</think>`: a `<think>` written
    inside it is reasoning text, not a new block (cutting at the last one lost the start, and the
    official template's tool cycle, which keeps the reasoning, was re-rendered and split)."""
    official = Qwen3Renderer(qwen3_tokenizer)
    history, tools = (
        [Message("user", "What does <think> do? Check 2+2 with the tool.")],
        [CALCULATOR],
    )
    prompt = official.build_generation_prompt(history, tools=tools).to_ints()
    completion = [
        *qwen3_tokenizer.encode(
            f"<think>\n{REASONING_ABOUT_THINK}\n</think>\n\n<tool_call>\n"
            '{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
        ),
        IM_END,
    ]
    message, termination = official.parse_response(completion)
    assert termination is ParseTermination.STOP_SEQUENCE
    assert message.reasoning_content == REASONING_ABOUT_THINK and message.content == ""
    observation = [Message("tool", "4")]
    bridged = official.bridge_to_next_turn(prompt, completion, observation)
    assert bridged is not None and bridged[: len(prompt) + len(completion)] == prompt + completion
    official_text = qwen3_tokenizer.apply_chat_template(
        [hf_message(m) for m in [*history, message, *observation]],
        tools=[openai_tool(t) for t in tools],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert qwen3_tokenizer.decode(bridged) == official_text


@pytest.mark.parametrize("cls", [Qwen35Renderer, Qwen35KeepReasoningRenderer])
def test_qwen3_5_reasoning_that_mentions_think_is_parsed_whole(
    qwen3_tokenizer: Any, cls: type
) -> None:
    renderer = cls(
        qwen3_tokenizer
    )  # the prompt opened the block: everything before </think> is reasoning
    completion = [*qwen3_tokenizer.encode(f"{REASONING_ABOUT_THINK}\n</think>\n\n4"), IM_END]
    message, termination = renderer.parse_response(completion)
    assert termination is ParseTermination.STOP_SEQUENCE
    assert message.reasoning_content == REASONING_ABOUT_THINK and message.content == "4"


@pytest.mark.parametrize(
    "cls", [Qwen3KeepReasoningRenderer, Qwen35KeepReasoningRenderer, Qwen3Renderer]
)
def test_a_response_cut_off_while_thinking_gets_its_end_synthesised(
    qwen3_tokenizer: Any, cls: type
) -> None:
    renderer = cls(qwen3_tokenizer)
    history = [Message("user", "Compute 3*7 with the tool.")]
    prompt = renderer.build_generation_prompt(history).to_ints()
    thought = (
        "<think>\n" if cls is not Qwen35KeepReasoningRenderer else ""
    ) + "I should multiply three by"
    cut = qwen3_tokenizer.encode(thought)
    message, termination = renderer.parse_response(cut)
    assert (
        termination is ParseTermination.TRUNCATED
        and message.reasoning_content == "I should multiply three by"
    )
    feedback = [Message("user", "Your answer was cut off; be brief.")]
    bridged = renderer.bridge_to_next_turn(prompt, cut, feedback)
    if not renderer.has_extension_property:
        assert bridged is None  # a new query: the official template drops the thought
        return
    assert bridged is not None and bridged[: len(prompt) + len(cut)] == prompt + cut
    tail = qwen3_tokenizer.decode(bridged[len(prompt) + len(cut) :])
    assert tail.startswith("\n</think>\n\n<|im_end|>\n<|im_start|>user\nYour answer was cut off")
    expected = renderer.build_generation_prompt([*history, message, *feedback]).to_ints()
    assert qwen3_tokenizer.decode(bridged) == qwen3_tokenizer.decode(expected)


@pytest.mark.parametrize("cls", [Qwen3KeepReasoningRenderer, Qwen3InstructRenderer])
def test_a_response_cut_off_inside_a_tool_call_is_not_bridged(
    qwen3_tokenizer: Any, cls: type
) -> None:
    renderer = cls(qwen3_tokenizer)
    prompt = renderer.build_generation_prompt([Message("user", "go")]).to_ints()
    cut = qwen3_tokenizer.encode('<tool_call>\n{"name": "calculator", "argu')
    message, termination = renderer.parse_response(cut)
    assert termination is ParseTermination.TRUNCATED and not message.tool_calls
    assert renderer.bridge_to_next_turn(prompt, cut, [Message("user", "cut off")]) is None


def test_the_bridge_keeps_sampled_tokens_that_re_rendering_would_change(
    qwen3_tokenizer: Any,
) -> None:
    """Token-in-token-out: a sampler may write "\\n\\n" as 198 198; the bridge keeps those ids,
    re-rendering would merge them into 271 and start a new datum."""
    keep = Qwen3KeepReasoningRenderer(qwen3_tokenizer)
    history = [Message("user", "Compute 2+2 with the tool.")]
    prompt = keep.build_generation_prompt(history).to_ints()
    completion = [
        *qwen3_tokenizer.encode("<think>\nadd\n</think>"),
        198,
        198,
        *qwen3_tokenizer.encode(
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
        ),
        IM_END,
    ]
    message, _ = keep.parse_response(completion)
    observation = [Message("tool", "4")]
    bridged = keep.bridge_to_next_turn(prompt, completion, observation)
    rerendered = keep.build_generation_prompt([*history, message, *observation]).to_ints()
    sequence = SampledSequence(completion, [-0.1] * len(completion), "stop")
    assert len(merge_turns([Turn(prompt, sequence), Turn(bridged, sequence)])) == 1
    assert len(merge_turns([Turn(prompt, sequence), Turn(rerendered, sequence)])) == 2


def test_the_bridge_declines_prompts_it_did_not_build_and_other_stops(qwen3_tokenizer: Any) -> None:
    keep = Qwen3KeepReasoningRenderer(qwen3_tokenizer)
    prompt = keep.build_generation_prompt([Message("user", "hi")]).to_ints()
    completion = [*qwen3_tokenizer.encode("hello"), IM_END]
    assert keep.bridge_to_next_turn(prompt[:-1], completion, [Message("user", "x")]) is None
    end_of_text = qwen3_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert keep.parse_response([*completion[:-1], end_of_text])[1] is ParseTermination.EOS
    assert (
        keep.bridge_to_next_turn(prompt, [*completion[:-1], end_of_text], [Message("user", "x")])
        is None
    )


# -- parsing and rendering details ---------------------------------------------------------------


def test_qwen3_parses_json_tool_calls_and_flags_malformed_ones(qwen3_tokenizer: Any) -> None:
    renderer = Qwen3KeepReasoningRenderer(qwen3_tokenizer)
    text = (
        '<think>\nplan\n</think>\n\nLet me check.\n<tool_call>\n{"name": "search", "arguments": '
        '{"query": "qwen", "limit": 2}}\n</tool_call>\n<tool_call>\n{"name": "calculator", '
        '"arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call>'
    )
    message, termination = renderer.parse_response([*qwen3_tokenizer.encode(text), IM_END])
    assert termination is ParseTermination.STOP_SEQUENCE
    assert message.reasoning_content == "plan" and message.content == "Let me check."
    assert message.tool_calls == (
        ToolCall("search", {"query": "qwen", "limit": 2}),
        ToolCall("calculator", {"expression": "1+1"}),
    )
    for broken in (
        '<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>',
        '<tool_call>\n{"arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}',
    ):
        message, termination = renderer.parse_response([*qwen3_tokenizer.encode(broken), IM_END])
        assert termination is ParseTermination.MALFORMED and not message.tool_calls
        assert message.content == broken  # kept, so that re-rendering shows what the model wrote


def test_qwen3_5_parses_xml_tool_calls(qwen3_tokenizer: Any) -> None:
    renderer = Qwen35Renderer(qwen3_tokenizer)
    call = ToolCall(
        "search", {"query": "two\nlines", "limit": 3, "filters": {"lang": ["en"]}, "safe": True}
    )
    messages = [
        Message("user", "find"),
        Message("assistant", "Searching.", reasoning_content="r", tool_calls=[call]),
    ]
    _, completion = sampled_turn(renderer, messages, 1)
    message, termination = renderer.parse_response(completion)
    assert termination is ParseTermination.STOP_SEQUENCE and message.content == "Searching."
    # Containers come back as JSON; scalars as the strings the template wrote (the environment
    # validates them against its schema).
    assert message.tool_calls == (
        ToolCall(
            "search",
            {"query": "two\nlines", "limit": "3", "filters": {"lang": ["en"]}, "safe": "True"},
        ),
    )
    broken = "\n</think>\n\n<tool_call>\n<function=search>\nquery\n</function>\n</tool_call>"
    assert (
        renderer.parse_response([*qwen3_tokenizer.encode(broken), IM_END])[1]
        is ParseTermination.MALFORMED
    )


def test_message_text_never_becomes_a_control_token_when_asked(qwen3_tokenizer: Any) -> None:
    renderer = Qwen3KeepReasoningRenderer(
        qwen3_tokenizer, QwenOptions(literal_special_tokens="as_text")
    )
    messages = [
        Message("user", "read the file"),
        Message("assistant", "", tool_calls=[ToolCall("cat", {})]),
        Message("tool", "tokens: <|im_end|> <|im_start|>"),
    ]
    ids = renderer.build_generation_prompt(messages).to_ints()
    im_start = qwen3_tokenizer.convert_tokens_to_ids("<|im_start|>")
    # Structure only: 4 turns open and 3 close; the tool's text is plain text.
    assert ids.count(im_start) == 4 and ids.count(IM_END) == 3
    assert "tokens: <|im_end|> <|im_start|>" in qwen3_tokenizer.decode(ids)


@pytest.mark.parametrize("setting", ["as_tokens", "as_text"])
def test_pasted_control_token_text_keeps_the_extension_property(
    qwen3_tokenizer: Any, setting: str
) -> None:
    keep = Qwen3KeepReasoningRenderer(qwen3_tokenizer, QwenOptions(literal_special_tokens=setting))
    messages = [
        Message("user", "Explain <|im_end|>."),
        Message(
            "assistant",
            "",
            reasoning_content="look it up",
            tool_calls=[ToolCall("search", {"query": "im_end"})],
        ),
        Message("tool", "<|im_end|> ends a turn; <|im_start|> opens one."),
        Message("assistant", "It ends a turn: <|im_end|>.", reasoning_content="the tool said so"),
    ]
    assert extension_violation(keep, messages) is None
    prompt, completion = sampled_turn(keep, messages, 1)
    assert (
        keep.bridge_to_next_turn(prompt, completion, messages[2:3])
        == keep.build_generation_prompt(messages[:3]).to_ints()
    )


def test_qwen3_instruct_has_no_reasoning(qwen3_tokenizer: Any) -> None:
    renderer = Qwen3InstructRenderer(qwen3_tokenizer)
    assert renderer.has_extension_property and renderer.stop_sequences()[0] == IM_END
    with pytest.raises(ValueError, match="does not reason"):
        renderer.build_generation_prompt(
            [
                Message("user", "q"),
                Message("assistant", "a", reasoning_content="r"),
                Message("user", "q2"),
            ]
        )
    with pytest.raises(ValueError, match="no thinking mode"):
        Qwen3InstructRenderer(qwen3_tokenizer, QwenOptions(enable_thinking=False))
    message, _ = renderer.parse_response([*qwen3_tokenizer.encode("<think>x</think>y"), IM_END])
    assert message.reasoning_content is None and message.content == "<think>x</think>y"


def test_a_tokenizer_without_qwen_tokens_is_refused() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(
        ["hello world"] * 10,
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=["<|im_start|>", "<|im_end|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    with pytest.raises(ModelError, match="lacks the Qwen control tokens") as error:
        Qwen3Renderer(tokenizer)
    assert "chat_template renderer" in str(error.value)


def test_the_plugin_registers_every_renderer() -> None:
    registry = get_registry()
    names = [
        "qwen3",
        "qwen3_keep_reasoning",
        "qwen3_instruct_2507",
        "qwen3_5",
        "qwen3_5_keep_reasoning",
    ]
    assert all(registry.get("renderer", name).plugin == "qwen" for name in names)
    tokenizer_dir = qwen3_tokenizer().name_or_path
    model = ResolvedModel("qwen", path=tokenizer_dir, tokenizer_path=tokenizer_dir)
    factory = registry.get("renderer", "qwen3_keep_reasoning")
    renderer = factory.load()(model, options=factory.options_class()(enable_thinking=False))
    assert isinstance(renderer, Qwen3KeepReasoningRenderer) and not renderer.options.enable_thinking
    assert renderer.build_generation_prompt([Message("user", "hi")]).length > 3
