"""A renderer driven by any Hugging Face chat template (Jinja, shipped in tokenizer_config.json).

It renders exactly what `tokenizer.apply_chat_template` renders. Because an arbitrary template may
rewrite history (drop reasoning, re-serialise tool calls), it does not claim the sequence-extension
property and offers no bridge: multi-turn rollouts re-render and prefix-check instead. Model-family
renderers (e.g. plait-qwen) can do better.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from plait.errors import ModelError
from plait.models import ResolvedModel
from plait.types import Message, ModelInput, ParseTermination, TrainOnWhat


@attrs.frozen
class ChatTemplateOptions:
    system_prompt: str | None = None
    """Prepended as a system message when a conversation has none."""
    chat_template: str | None = None
    """A Jinja template that replaces the tokenizer's own."""
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    """Extra variables passed to the template (e.g. enable_thinking = false)."""


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


class ChatTemplateRenderer:
    has_extension_property = False

    def __init__(self, tokenizer: Any, options: ChatTemplateOptions | None = None) -> None:
        self.tokenizer = tokenizer
        self.options = options or ChatTemplateOptions()
        if self.options.chat_template is not None:
            tokenizer.chat_template = self.options.chat_template
        if not getattr(tokenizer, "chat_template", None):
            raise ModelError(
                "the tokenizer has no chat template",
                fix="set renderer.options.chat_template, or use a renderer for the model family",
            )
        self._stop_ids = self._find_stop_ids()

    @classmethod
    def from_model(cls, model: ResolvedModel, *, options: ChatTemplateOptions | None = None) -> ChatTemplateRenderer:
        return cls(load_tokenizer(model.tokenizer_path), options)

    def _find_stop_ids(self) -> list[int]:
        ids: list[int] = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        # The end-of-turn token the template writes after an assistant message (e.g. <|im_end|>),
        # found by rendering a probe turn; it may differ from eos.
        probe = self._render_text([Message("user", "x"), Message("assistant", "PROBE")], False)
        tail = probe[probe.rindex("PROBE") + len("PROBE"):]
        for token_id in self.tokenizer.encode(tail, add_special_tokens=False)[:1]:
            if token_id in self.tokenizer.all_special_ids and token_id not in ids:
                ids.append(int(token_id))
        return ids

    def _with_system(self, messages: Sequence[Message]) -> list[Message]:
        if self.options.system_prompt is not None and (not messages or messages[0].role != "system"):
            return [Message("system", self.options.system_prompt), *messages]
        return list(messages)

    def _render_text(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [m.to_hf() for m in messages], tokenize=False,
            add_generation_prompt=add_generation_prompt, **self.options.template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def build_generation_prompt(
        self, messages: Sequence[Message], role: str = "assistant", prefill: str | None = None
    ) -> ModelInput:
        if role != "assistant":
            raise ValueError("the chat-template renderer only builds assistant generation prompts")
        text = self._render_text(self._with_system(messages), add_generation_prompt=True)
        return ModelInput.from_ints(self._encode(text + (prefill or "")))

    def build_supervised_example(
        self, messages: Sequence[Message], train_on: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_MESSAGE
    ) -> tuple[ModelInput, list[float]]:
        messages = self._with_system(messages)
        full = self._encode(self._render_text(messages, add_generation_prompt=False))
        weights = [1.0 if train_on is TrainOnWhat.ALL_TOKENS else 0.0] * len(full)
        assistant_turns = [i for i, m in enumerate(messages) if m.role == "assistant"]
        if train_on is TrainOnWhat.LAST_ASSISTANT_MESSAGE:
            assistant_turns = assistant_turns[-1:]
        if train_on is TrainOnWhat.ALL_MESSAGES:
            assistant_turns = list(range(len(messages)))
        for index in assistant_turns if train_on is not TrainOnWhat.ALL_TOKENS else ():
            start = len(self._encode(self._render_text(messages[:index], add_generation_prompt=True)))
            through_turn = self._encode(self._render_text(messages[: index + 1], add_generation_prompt=False))
            end = len(through_turn)
            if full[:end] != through_turn:
                raise ValueError(
                    "this chat template rewrites earlier turns, so per-turn weights are ambiguous; "
                    "build one example per turn instead"
                )
            for pos in range(start, min(end, len(full))):
                weights[pos] = 1.0
        return ModelInput.from_ints(full), weights

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, ParseTermination]:
        tokens = list(tokens)
        termination = ParseTermination.TRUNCATED
        if tokens and tokens[-1] in self._stop_ids:
            termination = (ParseTermination.EOS if tokens[-1] == self.tokenizer.eos_token_id
                           else ParseTermination.STOP_SEQUENCE)
            tokens = tokens[:-1]
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return Message("assistant", text), termination

    def stop_sequences(self) -> list[int]:
        return list(self._stop_ids)

    def bridge_to_next_turn(
        self, prev_prompt_ids: Sequence[int], prev_completion_ids: Sequence[int],
        new_messages: Sequence[Message],
    ) -> list[int] | None:
        return None
