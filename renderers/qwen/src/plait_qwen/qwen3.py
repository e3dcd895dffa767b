"""Qwen3 (hybrid thinking) and Qwen3-Instruct-2507: ChatML with JSON tool calls.

`Qwen3Renderer` writes what the official Qwen3 chat template writes (parity-tested token for token
against Hugging Face `apply_chat_template`). That template drops an assistant turn's reasoning once
a new user query follows it, and drops an *empty* `<think></think>` block as soon as anything
follows, so a sampled turn is not a prefix of the next prompt: no extension property.

`Qwen3KeepReasoningRenderer` keeps every turn as it was sampled: a turn with reasoning keeps its
`<think>` block wherever it sits, a turn without one has none (with thinking off, every turn has
the empty block the prompt gave it). It has the extension property, so a multi-turn episode trains
as one datum.

`Qwen3InstructRenderer` is for the 2507 Instruct models, which never think: no `<think>` handling,
generation prompt `<|im_start|>assistant\\n`; the history is never rewritten (extension property).
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.api import Message, ToolCall, ToolSpec
from plait_hf.formats import (
    THINK_CLOSE,
    THINK_OPEN,
    json_tool_call,
    openai_tool,
    split_reasoning,
    to_json,
)
from plait_qwen.chatml import (
    IM_END,
    IM_START,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    Piece,
    QwenRenderer,
)

QWEN3_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
QWEN3_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def template_reasoning(message: Message) -> tuple[str | None, str]:
    """(reasoning, content) the way the Qwen templates read an assistant message: the
    `reasoning_content` field, else a `<think>` block written into the content."""
    content = message.content
    if message.reasoning_content is not None:
        return message.reasoning_content, content
    if THINK_CLOSE in content:
        # The templates: reasoning before the first </think> (after its last <think>), content
        # after the last </think>.
        before = content.partition(THINK_CLOSE)[0]
        after = content.rpartition(THINK_CLOSE)[2]
        return before.rstrip("\n").rpartition(THINK_OPEN)[2].lstrip("\n"), after.lstrip("\n")
    return None, content


class _Qwen3Family(QwenRenderer):
    tool_call_format = "json"

    def _tool_call_text(self, call: ToolCall) -> str:
        return json_tool_call(call)

    def _head(self, first_system: Message | None, tools: Sequence[ToolSpec] | None) -> list[Piece]:
        if tools:
            system = first_system.content + "\n\n" if first_system is not None else ""
            declarations = "".join("\n" + to_json(openai_tool(t)) for t in tools)
            # The declarations are the environment's text, encoded like a message's.
            return [
                self._id(IM_START),
                "system\n",
                system,
                *self._template(QWEN3_TOOLS_INTRO),
                declarations,
                *self._template(QWEN3_TOOLS_OUTRO),
                self._id(IM_END),
                "\n",
            ]
        if first_system is not None:
            return [self._id(IM_START), "system\n" + first_system.content, self._id(IM_END), "\n"]
        return []

    def _message(self, messages: Sequence[Message], index: int, last_query: int) -> list[Piece]:
        message = messages[index]
        if message.role in ("user", "system"):
            return [
                self._id(IM_START),
                f"{message.role}\n" + message.content,
                self._id(IM_END),
                "\n",
            ]
        if message.role == "tool":
            previous = messages[index - 1].role if index > 0 else None
            following = messages[index + 1].role if index + 1 < len(messages) else None
            user_open: list[Piece] = [self._id(IM_START), "user"] if previous != "tool" else []
            user_close: list[Piece] = [self._id(IM_END), "\n"] if following != "tool" else []
            return [
                *user_open,
                "\n",
                self._id(TOOL_RESPONSE_OPEN),
                "\n" + message.content + "\n",
                self._id(TOOL_RESPONSE_CLOSE),
                *user_close,
            ]
        reasoning, content = self._assistant_reasoning(message)
        body: list[Piece]
        if self._frames_reasoning(reasoning, index, last_query, index == len(messages) - 1):
            body = [
                self._id(THINK_OPEN),
                "\n",
                (reasoning or "").strip("\n") + "\n",
                self._id(THINK_CLOSE),
                "\n\n" + content.lstrip("\n"),
            ]
        else:
            body = [content]
        return [
            self._id(IM_START),
            "assistant\n",
            *body,
            *self._tool_calls(message.tool_calls, "\n" if content else ""),
            self._id(IM_END),
            "\n",
        ]

    def _assistant_reasoning(self, message: Message) -> tuple[str | None, str]:
        return template_reasoning(message)

    def _frames_reasoning(
        self, reasoning: str | None, index: int, last_query: int, is_last: bool
    ) -> bool:
        raise NotImplementedError


class Qwen3Renderer(_Qwen3Family):
    """Qwen3 exactly as its official chat template renders it (history reasoning stripped)."""

    matches_official_template = True
    keep_reasoning = False

    def _frames_reasoning(
        self, reasoning: str | None, index: int, last_query: int, is_last: bool
    ) -> bool:
        # The template: after the last query, when the turn is the last message or reasoned.
        return index > last_query and (is_last or bool(reasoning))

    def _generation_pieces(self) -> list[Piece]:
        pieces: list[Piece] = [self._id(IM_START), "assistant\n"]
        if not self.options.enable_thinking:
            pieces += [self._id(THINK_OPEN), "\n\n", self._id(THINK_CLOSE), "\n\n"]
        return pieces

    def _split_reasoning(self, text: str) -> tuple[str | None, str]:
        reasoning, content = split_reasoning(text)
        if reasoning is None and not self.options.enable_thinking:
            return "", content  # the prompt gave the turn its (empty) block
        return reasoning, content


class Qwen3KeepReasoningRenderer(Qwen3Renderer):
    """Qwen3 with every turn kept as sampled: the sequence-extension property holds."""

    matches_official_template = False
    keep_reasoning = True

    def _frames_reasoning(
        self, reasoning: str | None, index: int, last_query: int, is_last: bool
    ) -> bool:
        return reasoning is not None or not self.options.enable_thinking


class Qwen3InstructRenderer(_Qwen3Family):
    """Qwen3-Instruct-2507: never thinks; history is written as it was sampled."""

    matches_official_template = False  # no copy of the 2507 template ships offline to test against
    keep_reasoning = True
    supports_thinking = False

    def _assistant_reasoning(self, message: Message) -> tuple[str | None, str]:
        if message.reasoning_content:
            raise ValueError(
                "Qwen3-Instruct-2507 does not reason, but a message has reasoning_content; "
                "use the qwen3 / qwen3_keep_reasoning renderer for thinking models"
            )
        return None, message.content

    def _frames_reasoning(
        self, reasoning: str | None, index: int, last_query: int, is_last: bool
    ) -> bool:
        return False

    def _generation_pieces(self) -> list[Piece]:
        return [self._id(IM_START), "assistant\n"]

    def _split_reasoning(self, text: str) -> tuple[str | None, str]:
        return None, text
