"""The ChatML machinery every Qwen renderer shares.

A conversation is rendered to *pieces*: special-token ids (`<|im_start|>`, `<think>`, ...), text,
and boundaries. Text between two ids is encoded in one go, exactly as Hugging Face tokenizes the
rendered string (added tokens split the text first, then byte-level BPE runs on each span), so a
renderer that writes the official template's text produces its token ids. Two deliberate
differences from tokenizing the whole string:

- Special-token text inside an assistant message (a stop token the model spelled with ordinary
  tokens: the token itself would have ended its turn) stays text; elsewhere it becomes the control
  token as the engines encode it, unless `literal_special_tokens = "as_text"` keeps all message
  text as text (a tool that prints "<|im_end|>" cannot end the turn).
- Renderers that claim the sequence-extension property put a boundary where the generation prompt
  ends inside an assistant turn, so that the history shows the turn with the token boundary the
  sampler saw (`<think>\\n` + `\\n</think>` is 198 198 when sampled, 271 when BPE merges "\\n\\n").

The family subclasses (`plait_qwen.qwen3`, `plait_qwen.qwen3_5`) write the messages; this module
turns pieces into ids, builds prompts and supervised examples, parses responses and bridges turns.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import attrs

from plait.api import (
    Message,
    ModelError,
    ModelInput,
    ParseTermination,
    ToolCall,
    ToolSpec,
    TrainOnWhat,
)
from plait_hf.chat_template import common_prefix_length, trained_span_end
from plait_hf.encoding import TokenEncoder
from plait_hf.formats import (
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCallFormat,
    parse_tool_calls,
)
from plait_hf.grammar import tool_call_grammar

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
REQUIRED_TOKENS = (
    IM_START,
    IM_END,
    END_OF_TEXT,
    THINK_OPEN,
    THINK_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_RESPONSE_OPEN,
    TOOL_RESPONSE_CLOSE,
)


class Boundary:
    """A token boundary: text on either side is encoded separately."""

    def __repr__(self) -> str:
        return "BOUNDARY"


BOUNDARY = Boundary()
Piece = int | str | Boundary


@attrs.frozen
class QwenOptions:
    enable_thinking: bool = True
    """False writes an empty `<think></think>` block into the generation prompt (the template's
    `enable_thinking=false`): the model answers without reasoning."""
    system_prompt: str | None = None
    """Prepended as a system message when a conversation has none."""
    literal_special_tokens: Literal["as_tokens", "as_text"] = attrs.field(
        default="as_tokens", validator=attrs.validators.in_(("as_tokens", "as_text"))
    )
    """How special-token text in a message (a user pasting "<|im_end|>") is encoded. "as_tokens":
    as the control token, like the official template with the model's tokenizer (what vLLM and
    SGLang produce). "as_text": as ordinary text, so that no message can end or open a turn.
    Either way a stop token spelled in an assistant message stays text (the model sampled it as
    text: the token would have ended its turn)."""


@attrs.frozen
class Rendered:
    """A conversation as pieces: the system/tools block, one list per message, the prompt."""

    head: list[Piece]
    messages: list[list[Piece]]
    generation: list[Piece]
    roles: list[str]
    """The role of each message: it decides how special-token text in it is encoded."""


Group = tuple[Sequence[Piece], frozenset[str]]
"""Pieces and the special tokens whose text stays text in them."""


class QwenRenderer:
    """Base of the Qwen renderers; subclasses write the family's format."""

    tool_call_format: ClassVar[ToolCallFormat]
    matches_official_template: ClassVar[bool]
    """True when the renderer produces the official chat template's token ids (parity-tested)."""
    keep_reasoning: ClassVar[bool]
    """True when history keeps every turn exactly as sampled (no reasoning is dropped)."""
    supports_thinking: ClassVar[bool] = True

    def __init__(self, tokenizer: Any, options: QwenOptions | None = None) -> None:
        self.tokenizer = tokenizer
        self.options = options or QwenOptions()
        if not self.supports_thinking and not self.options.enable_thinking:
            raise ValueError(
                f"{type(self).__name__} has no thinking mode to turn off; drop enable_thinking"
            )
        added = dict(tokenizer.get_added_vocab())
        missing = [t for t in REQUIRED_TOKENS if t not in added]
        if missing:
            raise ModelError(
                f"the tokenizer lacks the Qwen control tokens {missing}",
                fix="use a Qwen3 / Qwen3.5 tokenizer, or the chat_template renderer for other "
                "models",
            )
        self._added = {text: int(token_id) for text, token_id in added.items()}
        self._ids = {text: self._added[text] for text in REQUIRED_TOKENS}
        self._token_text = {token_id: text for text, token_id in added.items()}
        # Longest first, so that a token that contains another wins.
        self._added_pattern = re.compile(
            "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        )
        self._encoder = TokenEncoder.of(tokenizer)
        self._generation_ids = self._encode(self._generation_pieces())

    # -- family hooks --------------------------------------------------------------------

    @property
    def has_extension_property(self) -> bool:
        return self.keep_reasoning

    def _head(self, first_system: Message | None, tools: Sequence[ToolSpec] | None) -> list[Piece]:
        """The system block (with the tool declarations) that opens the conversation."""
        raise NotImplementedError

    def _message(self, messages: Sequence[Message], index: int, last_query: int) -> list[Piece]:
        """Message `index` (not a leading system message, which `_head` writes)."""
        raise NotImplementedError

    def _generation_pieces(self) -> list[Piece]:
        raise NotImplementedError

    def _split_reasoning(self, text: str) -> tuple[str | None, str]:
        """(reasoning, rest) of a sampled response, given what the generation prompt opened."""
        raise NotImplementedError

    def _tool_call_text(self, call: ToolCall) -> str:
        raise NotImplementedError

    # -- pieces ----------------------------------------------------------------------------

    def _id(self, token: str) -> int:
        return self._ids[token]

    def _template(self, text: str) -> list[Piece]:
        """Text the template itself writes: added tokens in it become their ids."""
        pieces: list[Piece] = []
        position = 0
        for match in self._added_pattern.finditer(text):
            if match.start() > position:
                pieces.append(text[position : match.start()])
            pieces.append(self._added[match.group()])
            position = match.end()
        if position < len(text):
            pieces.append(text[position:])
        return pieces

    def _tool_calls(self, calls: Sequence[ToolCall], first_separator: str) -> list[Piece]:
        """Calls in the family format; the call's own text (name, arguments) is message text."""
        pieces: list[Piece] = []
        for number, call in enumerate(calls):
            body = self._tool_call_text(call)[len(TOOL_CALL_OPEN) : -len(TOOL_CALL_CLOSE)]
            separator = first_separator if number == 0 else "\n"
            pieces += [
                *([separator] if separator else []),
                self._id(TOOL_CALL_OPEN),
                body,
                self._id(TOOL_CALL_CLOSE),
            ]
        return pieces

    def _text(self, pieces: Sequence[Piece]) -> str:
        return "".join(
            self._token_text[p] if isinstance(p, int) else p
            for p in pieces
            if not isinstance(p, Boundary)
        )

    def _kept_as_text(self, role: str) -> frozenset[str]:
        """The special tokens whose text stays text in a message of `role`."""
        if self.options.literal_special_tokens == "as_text":
            return self._encoder.special_tokens
        if role == "assistant":
            # The model's own turn: sampling ends at a stop token, so a stop token spelled inside
            # the turn was sampled as ordinary tokens (a re-render must not end the turn there).
            return frozenset(self._token_text[t] for t in self.stop_sequences())
        return frozenset()

    def _encode(
        self, pieces: Sequence[Piece], kept_as_text: frozenset[str] = frozenset()
    ) -> list[int]:
        return self._encode_groups([(pieces, kept_as_text)])

    def _encode_groups(self, groups: Sequence[Group]) -> list[int]:
        """Ids of the pieces of every group, in order. Text runs on across groups (it is encoded
        in one go, as the tokenizer encodes the rendered string); each group's rule for
        special-token text holds in the text it contributed."""
        ids: list[int] = []
        run: list[tuple[str, frozenset[str]]] = []

        def flush() -> None:
            if not run:
                return
            starts, offset = [], 0
            for text, _ in run:
                starts.append(offset)
                offset += len(text)

            def keep_as_text(start: int, token: str) -> bool:
                return token in run[bisect.bisect_right(starts, start) - 1][1]

            ids.extend(self._encoder.encode("".join(text for text, _ in run), keep_as_text))
            run.clear()

        for pieces, kept in groups:
            for piece in pieces:
                if isinstance(piece, str):
                    run.append((piece, kept))
                else:
                    flush()
                    if isinstance(piece, int):
                        ids.append(piece)
        flush()
        return ids

    def _break_after_generation_prompt(self, pieces: list[Piece]) -> list[Piece]:
        """Pieces of an assistant turn with a boundary where the generation prompt ends, when the
        turn starts with it (renderers with the extension property)."""
        prefix = self._text(self._generation_pieces())
        consumed = 0
        for position, piece in enumerate(pieces):
            text = self._text([piece])
            if consumed + len(text) <= len(prefix):
                if prefix[consumed : consumed + len(text)] != text:
                    return pieces
                consumed += len(text)
                if consumed == len(prefix):
                    return [*pieces[: position + 1], BOUNDARY, *pieces[position + 1 :]]
                continue
            cut = len(prefix) - consumed  # the prompt ends inside this piece
            if not isinstance(piece, str) or piece[:cut] != prefix[consumed:]:
                return pieces
            return [*pieces[:position], piece[:cut], BOUNDARY, piece[cut:], *pieces[position + 1 :]]
        return pieces

    def _with_system(self, messages: Sequence[Message]) -> list[Message]:
        if self.options.system_prompt is not None and (
            not messages or messages[0].role != "system"
        ):
            return [Message("system", self.options.system_prompt), *messages]
        return list(messages)

    def _render(self, messages: Sequence[Message], tools: Sequence[ToolSpec] | None) -> Rendered:
        for message in messages:
            if message.role not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"unknown message role {message.role!r}")
        first_system = messages[0] if messages and messages[0].role == "system" else None
        last_query = self._last_query_index(messages)
        rendered: list[list[Piece]] = []
        for index in range(len(messages)):
            if index == 0 and first_system is not None:
                rendered.append([])  # written by the head
                continue
            pieces = self._message(messages, index, last_query)
            if messages[index].role == "assistant" and self.keep_reasoning:
                pieces = self._break_after_generation_prompt(pieces)
            rendered.append(pieces)
        return Rendered(
            self._head(first_system, tools),
            rendered,
            self._generation_pieces(),
            [m.role for m in messages],
        )

    def _groups(self, rendered: Rendered, start: int = 0) -> list[Group]:
        """Messages `start`... of a rendered conversation, each with its role's rule."""
        return [
            (pieces, self._kept_as_text(role))
            for pieces, role in zip(rendered.messages[start:], rendered.roles[start:], strict=True)
        ]

    @staticmethod
    def _is_tool_response_wrapper(content: str) -> bool:
        return content.startswith(TOOL_RESPONSE_OPEN) and content.endswith(TOOL_RESPONSE_CLOSE)

    def _last_query_index(self, messages: Sequence[Message]) -> int:
        """The last user message that is a real query (not tool output), as the templates find
        it; the last index when there is none."""
        for index in range(len(messages) - 1, -1, -1):
            message = messages[index]
            if message.role == "user" and not self._is_tool_response_wrapper(
                self._content(message.content)
            ):
                return index
        return len(messages) - 1

    def _content(self, text: str) -> str:
        """Message text as the template uses it (Qwen3.5 trims it)."""
        return text

    # -- the Renderer protocol ---------------------------------------------------------------

    def build_generation_prompt(
        self,
        messages: Sequence[Message],
        role: str = "assistant",
        prefill: str | None = None,
        tools: Sequence[ToolSpec] | None = None,
    ) -> ModelInput:
        if role != "assistant":
            raise ValueError(f"{type(self).__name__} only builds assistant generation prompts")
        rendered = self._render(self._with_system(messages), tools)
        # A prefill is the start of the assistant's turn.
        generation = [*rendered.generation, *([prefill] if prefill else [])]
        return ModelInput.from_ints(
            self._encode_groups(
                [
                    (rendered.head, self._kept_as_text("system")),
                    *self._groups(rendered),
                    (generation, self._kept_as_text("assistant")),
                ]
            )
        )

    def _encode_messages(self, rendered: Rendered) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of head + messages and each message's (start, end) span. Every message
        starts or ends at a control token, so encoding message by message equals encoding the
        whole text."""
        tokens = self._encode(rendered.head, self._kept_as_text("system"))
        spans = []
        for group in self._groups(rendered):
            start = len(tokens)
            tokens += self._encode_groups([group])
            spans.append((start, len(tokens)))
        return tokens, spans

    def build_supervised_example(
        self,
        messages: Sequence[Message],
        train_on: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_MESSAGE,
        tools: Sequence[ToolSpec] | None = None,
    ) -> tuple[ModelInput, list[float]]:
        messages = self._with_system(messages)
        tokens, spans = self._encode_messages(self._render(messages, tools))
        if train_on is TrainOnWhat.ALL_TOKENS:
            return ModelInput.from_ints(tokens), [1.0] * len(tokens)
        trained = [i for i, m in enumerate(messages) if m.role == "assistant"]
        if train_on is TrainOnWhat.LAST_ASSISTANT_MESSAGE:
            trained = trained[-1:]
        if train_on is TrainOnWhat.ALL_MESSAGES:
            trained = list(range(len(messages)))
        weights = [0.0] * len(tokens)
        stops = [self._id(IM_END)]
        for index in trained:
            start, end = spans[index]
            if messages[index].role == "assistant":
                # Train on what the model writes after the generation prompt.
                start += common_prefix_length(tokens[start:end], self._generation_ids)
            for position in range(start, trained_span_end(tokens, start, end, stops)):
                weights[position] = 1.0
        return ModelInput.from_ints(tokens), weights

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        tokens = list(tokens)
        termination = ParseTermination.TRUNCATED
        if tokens and tokens[-1] == self._id(IM_END):
            termination, tokens = ParseTermination.STOP_SEQUENCE, tokens[:-1]
        elif tokens and tokens[-1] == self._id(END_OF_TEXT):
            termination, tokens = ParseTermination.EOS, tokens[:-1]
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        reasoning, rest = self._split_reasoning(text)
        parsed = parse_tool_calls(rest, self.tool_call_format, complete=termination.is_clean)
        if parsed.error is not None:
            # Keep the raw text, so that re-rendering shows the model what it wrote.
            return Message(
                "assistant", rest, reasoning_content=reasoning
            ), ParseTermination.MALFORMED
        return Message(
            "assistant", parsed.content, reasoning_content=reasoning, tool_calls=parsed.calls
        ), termination

    def stop_sequences(self) -> list[int]:
        return [self._id(IM_END), self._id(END_OF_TEXT)]

    def tool_call_grammar(self, tools: Sequence[ToolSpec], *, parallel: bool = True) -> str:
        """GBNF of a response that only calls `tools`, in the family's format (for tool_choice
        "required" or a named tool; see `plait_hf.grammar`). Where the generation prompt opens a
        reasoning block, the response closes it first, empty."""
        opens_reasoning = self._generation_pieces()[-2] == self._id(THINK_OPEN)
        return tool_call_grammar(
            tools, self.tool_call_format, parallel=parallel, after_open_reasoning=opens_reasoning
        )

    def bridge_to_next_turn(
        self,
        prev_prompt_ids: Sequence[int],
        prev_completion_ids: Sequence[int],
        new_messages: Sequence[Message],
    ) -> list[int] | None:
        if not new_messages or any(m.role not in ("user", "tool") for m in new_messages):
            return None
        prompt, completion = list(prev_prompt_ids), list(prev_completion_ids)
        if prompt[len(prompt) - len(self._generation_ids) :] != self._generation_ids:
            return None  # not a prompt this renderer built
        message, _ = self.parse_response(completion)
        # The sampled turn as the latest reply of a probe conversation, then with the new
        # messages after it: what follows a turn does not depend on the history before it.
        probe = [Message("user", "x")]
        after = self._render([*probe, message, *new_messages], None)
        if self.keep_reasoning and completion and completion[-1] == self._id(IM_END):
            tail = "\n"  # history keeps the turn as sampled; the newline after <|im_end|> follows
        else:
            # The official templates rewrite history (a turn loses its reasoning once a new query
            # follows) and normalise whitespace; a cut-off turn needs its end written.
            with_turn = self._render([*probe, message], None)
            if after.messages[:2] != with_turn.messages[:2]:
                return None
            rendered_turn = self._text(with_turn.messages[1])
            sampled = self._text(self._generation_pieces()) + self.tokenizer.decode(
                completion, skip_special_tokens=False
            )
            if not rendered_turn.startswith(sampled):
                return None
            tail = rendered_turn[len(sampled) :]
        return [
            *prompt,
            *completion,
            *self._encode_groups(
                [
                    (self._template(tail), frozenset()),
                    *self._groups(after, start=2),
                    (after.generation, frozenset()),
                ]
            ),
        ]
