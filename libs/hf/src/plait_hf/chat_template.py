"""A renderer driven by any Hugging Face chat template (Jinja, shipped in tokenizer_config.json).

It renders exactly what `tokenizer.apply_chat_template` renders, tools included (passed to the
template as OpenAI-style function schemas). Sampled responses are parsed back into messages: a
`<think>` block becomes `reasoning_content` when the template knows reasoning, and tool calls are
read when the template writes a known format (see `plait_hf.formats`).

An arbitrary template may rewrite history (drop reasoning, re-serialise tool calls), so this
renderer does not claim the sequence-extension property. Its `bridge_to_next_turn` checks, by
rendering, that the template would show the model exactly the text it sampled followed by the new
messages, and then appends only the new tokens (the approach of Miles' TITO tokenizer); otherwise
it returns None and the rollout re-renders. Model-family renderers (e.g. plait-qwen) can do better.

Text is encoded as the engines encode it (a message that spells "<|im_end|>" gets the control
token), with one exception: a stop token spelled inside an assistant message stays text. The model
sampled it as ordinary tokens (the token itself would have ended its turn), and a re-rendered
history must not show that turn ending early.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from plait.api import (
    Message,
    ModelError,
    ModelInput,
    ParseTermination,
    ResolvedModel,
    ToolSpec,
    TrainOnWhat,
)
from plait_hf.encoding import TokenEncoder
from plait_hf.formats import (
    THINK_CLOSE,
    THINK_OPEN,
    ToolCallFormat,
    detect_tool_call_format,
    hf_message,
    openai_tool,
    parse_tool_calls,
    split_reasoning,
)
from plait_hf.grammar import tool_call_grammar


@attrs.frozen
class ChatTemplateOptions:
    system_prompt: str | None = None
    """Prepended as a system message when a conversation has none."""
    chat_template: str | None = None
    """A Jinja template that replaces the tokenizer's own."""
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    """Extra variables passed to the template (e.g. enable_thinking = false)."""
    tool_call_format: Literal["auto", "json", "xml", "none"] = "auto"
    """How the model writes tool calls; "auto" recognises the format from the template."""


def load_tokenizer(path: Any) -> Any:
    """A Hugging Face fast tokenizer from a local directory (never the hub)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"cannot load a tokenizer from {path}: {exc}",
            fix="set model.tokenizer to a directory with tokenizer.json / tokenizer_config.json",
        ) from exc


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def trained_span_end(tokens: Sequence[int], start: int, end: int, stop_ids: Sequence[int]) -> int:
    """The end of a message's trained tokens: through its last stop token, so that what a
    template writes after the stop (a newline the model never samples) is not trained."""
    for position in range(end - 1, start - 1, -1):
        if tokens[position] in stop_ids:
            return position + 1
    return end


class ChatTemplateRenderer:
    has_extension_property = False

    def __init__(self, tokenizer: Any, options: ChatTemplateOptions | None = None) -> None:
        self.tokenizer = tokenizer
        self.options = options or ChatTemplateOptions()
        if self.options.chat_template is not None:
            tokenizer.chat_template = self.options.chat_template
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ModelError(
                "the tokenizer has no chat template",
                fix="set renderer.options.chat_template, or use a renderer for the model family",
            )
        if not isinstance(template, str):  # a dict of named templates: use the default one
            template = str(template.get("default", ""))
        self.tool_call_format: ToolCallFormat | None = (
            detect_tool_call_format(template)
            if self.options.tool_call_format == "auto"
            else None
            if self.options.tool_call_format == "none"
            else self.options.tool_call_format
        )
        self._knows_reasoning = THINK_CLOSE in template
        self._stop_ids = self._find_stop_ids()
        probe = self._with_system([Message("user", "x")])
        self._generation_suffix = self._render_text(probe, True)[
            len(self._render_text(probe, False)) :
        ]
        self._prompt_opens_reasoning = self._generation_suffix.rstrip().endswith(THINK_OPEN)

    @classmethod
    def from_model(
        cls, model: ResolvedModel, *, options: ChatTemplateOptions | None = None
    ) -> ChatTemplateRenderer:
        return cls(load_tokenizer(model.tokenizer_path), options)

    def _find_stop_ids(self) -> list[int]:
        ids: list[int] = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        # The end-of-turn token the template writes after an assistant message (e.g. <|im_end|>),
        # found by rendering a probe turn; it may differ from eos.
        probe = self._render_text([Message("user", "x"), Message("assistant", "PROBE")], False)
        tail = probe[probe.rindex("PROBE") + len("PROBE") :]
        for token_id in self.tokenizer.encode(tail, add_special_tokens=False)[:1]:
            if token_id in self.tokenizer.all_special_ids and token_id not in ids:
                ids.append(int(token_id))
        return ids

    def _with_system(self, messages: Sequence[Message]) -> list[Message]:
        if self.options.system_prompt is not None and (
            not messages or messages[0].role != "system"
        ):
            return [Message("system", self.options.system_prompt), *messages]
        return list(messages)

    def _render_text(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[ToolSpec] | None = None,
    ) -> str:
        return self._apply_template([hf_message(m) for m in messages], add_generation_prompt, tools)

    def _apply_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[ToolSpec] | None,
    ) -> str:
        if not messages:
            return ""
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                tools=[openai_tool(t) for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                **self.options.template_kwargs,
            )
        except TemplateError as exc:  # the template's own raise_exception(...)
            raise ValueError(f"the chat template refuses this conversation: {exc}") from exc

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _render_ids(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool,
        tools: Sequence[ToolSpec] | None = None,
        prefill: str = "",
    ) -> list[int]:
        """The rendered conversation's ids, with a stop token spelled inside an assistant message
        kept as text. The template gets that text with a marker character before each such
        stop token, so that its place is known in the rendered string (templates transform
        content: strip it, split reasoning off, drop it)."""
        hf = [hf_message(m) for m in messages]
        stops = [self.tokenizer.convert_ids_to_tokens(i) for i in self._stop_ids]
        if not any(
            stop in text
            for m in hf
            if m["role"] == "assistant"
            for text in _strings(m)
            for stop in stops
        ):
            return self._encode(self._apply_template(hf, add_generation_prompt, tools) + prefill)
        used = "".join(_strings([hf, [openai_tool(t) for t in tools or ()], prefill]))
        marker = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)  # private use

        stop_pattern = re.compile(
            "|".join(re.escape(stop) for stop in sorted(stops, key=len, reverse=True))
        )

        def mark(value: Any) -> Any:
            if isinstance(value, str):
                return stop_pattern.sub(lambda match: marker + match.group(), value)
            if isinstance(value, dict):
                return {mark(k): mark(v) for k, v in value.items()}
            if isinstance(value, list | tuple):
                return [mark(v) for v in value]
            return value

        marked = [mark(m) if m["role"] == "assistant" else m for m in hf]
        pieces = (self._apply_template(marked, add_generation_prompt, tools) + prefill).split(
            marker
        )
        text, kept = pieces[0], set()
        for piece in pieces[1:]:
            kept.add(len(text))
            text += piece
        return TokenEncoder.of(self.tokenizer).encode(
            text, lambda start, token: start in kept and token in stops
        )

    def build_generation_prompt(
        self,
        messages: Sequence[Message],
        role: str = "assistant",
        prefill: str | None = None,
        tools: Sequence[ToolSpec] | None = None,
    ) -> ModelInput:
        if role != "assistant":
            raise ValueError("the chat-template renderer only builds assistant generation prompts")
        return ModelInput.from_ints(
            self._render_ids(self._with_system(messages), True, tools, prefill or "")
        )

    def build_supervised_example(
        self,
        messages: Sequence[Message],
        train_on: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_MESSAGE,
        tools: Sequence[ToolSpec] | None = None,
    ) -> tuple[ModelInput, list[float]]:
        messages = self._with_system(messages)
        full = self._render_ids(messages, False, tools)
        if train_on is TrainOnWhat.ALL_TOKENS:
            return ModelInput.from_ints(full), [1.0] * len(full)
        weights = [0.0] * len(full)
        trained = [i for i, m in enumerate(messages) if m.role == "assistant"]
        if train_on is TrainOnWhat.LAST_ASSISTANT_MESSAGE:
            trained = trained[-1:]
        if train_on is TrainOnWhat.ALL_MESSAGES:
            trained = list(range(len(messages)))
        for index in trained:
            # An assistant turn is trained from where it leaves its generation prompt (a template
            # may tokenize the turn's start differently, e.g. BPE-merge "\n\n"); others whole.
            assistant = messages[index].role == "assistant"
            before = self._render_ids(messages[:index], assistant, tools)
            start = common_prefix_length(full, before) if assistant else len(before)
            through_turn = self._render_ids(messages[: index + 1], False, tools)
            if full[: len(through_turn)] != through_turn:
                raise ValueError(
                    "this chat template rewrites earlier turns, so per-turn weights are ambiguous; "
                    "build one example per turn instead"
                )
            for position in range(
                start, trained_span_end(full, start, len(through_turn), self._stop_ids)
            ):
                weights[position] = 1.0
        return ModelInput.from_ints(full), weights

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        tokens = list(tokens)
        termination = ParseTermination.TRUNCATED
        if tokens and tokens[-1] in self._stop_ids:
            termination = (
                ParseTermination.EOS
                if tokens[-1] == self.tokenizer.eos_token_id
                else ParseTermination.STOP_SEQUENCE
            )
            tokens = tokens[:-1]
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        reasoning, content = (
            split_reasoning(text, prompt_opened=self._prompt_opens_reasoning)
            if self._knows_reasoning
            else (None, text)
        )
        if self.tool_call_format is None:
            return Message("assistant", content, reasoning_content=reasoning), termination
        parsed = parse_tool_calls(content, self.tool_call_format, complete=termination.is_clean)
        if parsed.error is not None:
            return Message(
                "assistant", content, reasoning_content=reasoning
            ), ParseTermination.MALFORMED
        return Message(
            "assistant", parsed.content, reasoning_content=reasoning, tool_calls=parsed.calls
        ), termination

    def stop_sequences(self) -> list[int]:
        return list(self._stop_ids)

    def tool_call_grammar(self, tools: Sequence[ToolSpec], *, parallel: bool = True) -> str:
        """GBNF of a response that only calls `tools`, in the template's tool-call format (for
        tool_choice "required" or a named tool; see `plait_hf.grammar`)."""
        if self.tool_call_format is None:
            raise ValueError(
                "the chat template writes tool calls in no format plait knows (json or xml), so "
                "it has no grammar for them; set the renderer option tool_call_format"
            )
        return tool_call_grammar(
            tools,
            self.tool_call_format,
            parallel=parallel,
            after_open_reasoning=self._prompt_opens_reasoning,
        )

    def bridge_to_next_turn(
        self,
        prev_prompt_ids: Sequence[int],
        prev_completion_ids: Sequence[int],
        new_messages: Sequence[Message],
    ) -> list[int] | None:
        if not new_messages or any(m.role not in ("user", "tool") for m in new_messages):
            return None
        completion = list(prev_completion_ids)
        prompt_text = self.tokenizer.decode(list(prev_prompt_ids), skip_special_tokens=False)
        if not prompt_text.endswith(self._generation_suffix):
            return None  # not a prompt this renderer built
        message, _ = self.parse_response(completion)
        # Render the sampled turn as the latest reply of a probe conversation (what follows the
        # turn does not depend on the history before it in any template we know of).
        probe = self._with_system([Message("user", "x")])
        before = self._render_text(probe, True)
        with_turn = self._render_text([*probe, message], False)
        after = self._render_text([*probe, message, *new_messages], True)
        sampled = self.tokenizer.decode(completion, skip_special_tokens=False)
        rendered_turn = with_turn[len(before) :]
        if not (
            with_turn.startswith(before)
            and rendered_turn.startswith(sampled)
            and after.startswith(with_turn)
        ):
            return None  # the template shows the turn differently, now or once more follows
        # What the template writes after the sampled text (the end-of-turn token when the
        # response was cut off, the newline after it), then the new messages and the prompt.
        delta = rendered_turn[len(sampled) :] + after[len(with_turn) :]
        return [*prev_prompt_ids, *completion, *self._encode(delta)]


def _strings(value: Any) -> list[str]:
    """Every string in a message dict (keys included): what a template may write."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [text for k, v in value.items() for text in (*_strings(k), *_strings(v))]
    if isinstance(value, list | tuple):
        return [text for v in value for text in _strings(v)]
    return []
