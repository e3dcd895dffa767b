"""Qwen3.5: ChatML with XML tool calls, a generation prompt that opens `<think>`, trimmed text.

`Qwen35Renderer` writes what the official Qwen3.5 chat template writes (parity-tested against the
template llama.cpp vendors as `Qwen3.5-4B.jinja`): every assistant turn after the last user query
has a `<think>` block (empty when it did not reason), turns before it lose theirs. Thinking on, the
prompt ends in `<think>\\n`; off, in an empty `<think>\\n\\n</think>\\n\\n`.

`Qwen35KeepReasoningRenderer` gives every assistant turn its block wherever it sits (Qwen3.6's
`preserve_thinking`), and keeps the token boundary where the prompt ended, so that an empty
reasoning turn is `<think>` 198 | 198 `</think>` as sampled rather than 271 as BPE would merge it:
the sequence-extension property holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from plait.api import Message, ToolCall, ToolSpec
from plait_hf.formats import (
    THINK_CLOSE,
    THINK_OPEN,
    openai_tool,
    split_reasoning,
    to_json,
    xml_tool_call,
)
from plait_qwen.chatml import (
    IM_END,
    IM_START,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    Piece,
    QwenRenderer,
)
from plait_qwen.qwen3 import template_reasoning

QWEN35_TOOLS_INTRO = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
QWEN35_TOOLS_OUTRO = (
    "\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n"
    "<function=example_function_name>\n"
    "<parameter=example_parameter_1>\n"
    "value_1\n"
    "</parameter>\n"
    "<parameter=example_parameter_2>\n"
    "This is the value for the second parameter\n"
    "that can span\n"
    "multiple lines\n"
    "</parameter>\n"
    "</function>\n"
    "</tool_call>\n\n"
    "<IMPORTANT>\n"
    "Reminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block "
    "must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the "
    "function call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n"
    "</IMPORTANT>"
)


class Qwen35Renderer(QwenRenderer):
    """Qwen3.5 exactly as its official chat template renders it (history reasoning stripped)."""

    tool_call_format = "xml"
    matches_official_template = True
    keep_reasoning = False

    def _content(self, text: str) -> str:
        return text.strip()

    def _tool_call_text(self, call: ToolCall) -> str:
        return xml_tool_call(call)

    def _head(self, first_system: Message | None, tools: Sequence[ToolSpec] | None) -> list[Piece]:
        system = self._content(first_system.content) if first_system is not None else None
        if tools:
            declarations = "".join("\n" + to_json(openai_tool(t)) for t in tools)
            # The declarations are the environment's text, encoded like a message's.
            return [
                self._id(IM_START),
                "system\n",
                *self._template(QWEN35_TOOLS_INTRO),
                declarations,
                *self._template(QWEN35_TOOLS_OUTRO),
                *(["\n\n" + system] if system else []),
                self._id(IM_END),
                "\n",
            ]
        if system is not None:
            return [self._id(IM_START), "system\n" + system, self._id(IM_END), "\n"]
        return []

    def _last_query_index(self, messages: Sequence[Message]) -> int:
        index = super()._last_query_index(messages)
        if self.matches_official_template and not (
            messages
            and messages[index].role == "user"
            and not self._is_tool_response_wrapper(self._content(messages[index].content))
        ):
            raise ValueError(
                "the Qwen3.5 template needs a user message (it raises 'No user query found')"
            )
        return index

    def _message(self, messages: Sequence[Message], index: int, last_query: int) -> list[Piece]:
        message = messages[index]
        content = self._content(message.content)
        if message.role == "system":
            raise ValueError("Qwen3.5 allows a system message only at the beginning")
        if message.role == "user":
            return [self._id(IM_START), "user\n" + content, self._id(IM_END), "\n"]
        if message.role == "tool":
            previous = messages[index - 1].role if index > 0 else None
            following = messages[index + 1].role if index + 1 < len(messages) else None
            user_open: list[Piece] = (
                [self._id(IM_START), "user"] if previous not in (None, "tool") else []
            )
            user_close: list[Piece] = [self._id(IM_END), "\n"] if following != "tool" else []
            return [
                *user_open,
                "\n",
                self._id(TOOL_RESPONSE_OPEN),
                "\n" + content + "\n",
                self._id(TOOL_RESPONSE_CLOSE),
                *user_close,
            ]
        reasoning, content = template_reasoning(attrs.evolve(message, content=content))
        body: list[Piece]
        if self.keep_reasoning or index > last_query:
            body = [
                self._id(THINK_OPEN),
                "\n",
                (reasoning or "").strip() + "\n",
                self._id(THINK_CLOSE),
                "\n\n" + content,
            ]
        else:
            body = [content]
        return [
            self._id(IM_START),
            "assistant\n",
            *body,
            *self._tool_calls(message.tool_calls, "\n\n" if content.strip() else ""),
            self._id(IM_END),
            "\n",
        ]

    def _generation_pieces(self) -> list[Piece]:
        if self.options.enable_thinking:
            return [self._id(IM_START), "assistant\n", self._id(THINK_OPEN), "\n"]
        return [
            self._id(IM_START),
            "assistant\n",
            self._id(THINK_OPEN),
            "\n\n",
            self._id(THINK_CLOSE),
            "\n\n",
        ]

    def _split_reasoning(self, text: str) -> tuple[str | None, str]:
        if not self.options.enable_thinking:
            reasoning, content = split_reasoning(text)
            return reasoning or "", content
        return split_reasoning(text, prompt_opened=True)


class Qwen35KeepReasoningRenderer(Qwen35Renderer):
    """Qwen3.5 with every turn's reasoning kept: the sequence-extension property holds."""

    matches_official_template = False
    keep_reasoning = True
