"""What every API the proxy speaks comes down to: a chat request in plait's own terms, and the
completion the engine sampled for it.

Each wire format (`openai_chat`, `openai_responses`, `anthropic_messages`) parses its request
body into a `ChatRequest` and writes a `Completion` back in its own shape; the proxy in between
(`plait_proxy.proxy`) only ever sees these types.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import attrs
import jsonschema

from plait.api import Message, ParseTermination, SampledSequence, ToolSpec

FinishReason = Literal["stop", "length", "tool_calls"]


class RequestError(Exception):
    """A request the proxy cannot serve, answered with `status` (4xx) and a message that says
    what to change. `param` names the offending field, as OpenAI's errors do."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.kind = kind


@runtime_checkable
class ToolCallGrammarRenderer(Protocol):
    """An optional renderer capability (beside `plait.protocols.Renderer`): the grammar (GBNF,
    `SamplingParams.grammar`) of a response that only calls `tools`, written in the renderer's
    tool-call format. The proxy needs it for tool_choice "required" and a named tool; plait-qwen's
    renderers and plait-hf's chat_template renderer have it. ValueError: no grammar here."""

    def tool_call_grammar(self, tools: Sequence[ToolSpec], *, parallel: bool = True) -> str: ...


@attrs.frozen
class ChatRequest:
    """A chat completion request, whatever API it came in through."""

    model: str
    messages: tuple[Message, ...] = attrs.field(converter=tuple[Message, ...])
    max_tokens: int | None = None
    """None: as many as the context allows (up to the proxy's `max_tokens`)."""
    tools: tuple[ToolSpec, ...] = attrs.field(converter=tuple[ToolSpec, ...], factory=tuple)
    tool_choice: str = "auto"
    """"auto", "none" (tools hidden from the model), "required", or the name of a tool (only
    that tool is shown). Under "required" and a named tool, decoding is constrained to calls of
    the shown tools by the renderer's grammar (`ToolCallGrammarRenderer`)."""
    parallel_tool_calls: bool = True
    """Under a constrained tool_choice: one or more calls (True), or exactly one."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(converter=tuple[str, ...], factory=tuple)
    """The client's stop strings; the renderer's own stop tokens always apply as well."""
    n: int = 1
    stream: bool = False
    logprobs: bool = False
    extra: dict[str, Any] = attrs.field(factory=dict)
    """Fields an API needs to echo back (e.g. OpenAI's `stream_options`, a Responses
    `instructions`); the proxy ignores them."""

    def shown_tools(self) -> tuple[ToolSpec, ...]:
        """The tools rendered into the prompt under `tool_choice`."""
        if self.tool_choice == "none":
            return ()
        if self.tool_choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.tool_choice)


@attrs.frozen
class Choice:
    """One sampled completion and what the renderer read in it."""

    index: int
    sequence: SampledSequence
    """The ids and logprobs exactly as sampled (cut after the token that completed a client stop
    string, as an engine that stops on strings would have stopped)."""
    message: Message
    termination: ParseTermination
    finish_reason: FinishReason
    stop_string: str | None = None
    """The client stop string that ended it, if one did."""
    token_texts: tuple[str, ...] = attrs.field(converter=tuple[str, ...], factory=tuple)
    """The decoded text of each sampled token, for APIs that return logprobs per token."""


@attrs.frozen
class Completion:
    """What the proxy answers one request with."""

    id: str
    model: str
    created: int
    prompt_ids: tuple[int, ...] = attrs.field(converter=tuple[int, ...])
    choices: tuple[Choice, ...] = attrs.field(converter=tuple[Choice, ...])

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.sequence.tokens) for c in self.choices)


def tool_schema_problem(schema: dict[str, Any]) -> str | None:
    """What makes a tool's parameters no JSON Schema of an object (as both APIs require them),
    or None. Checked against the metaschema its `$schema` names (2020-12 without one)."""
    if "type" in schema and schema["type"] != "object":
        return f'its `type` must be "object", got {json.dumps(schema["type"])[:40]}'
    text = json.dumps(schema, sort_keys=True)
    # agents send the same tools on every call: a schema of a usual size is checked once
    return _known_schema_problem(text) if len(text) <= 16384 else _metaschema_problem(schema)


@functools.lru_cache(maxsize=1024)
def _known_schema_problem(schema_json: str) -> str | None:
    return _metaschema_problem(json.loads(schema_json))


def _metaschema_problem(schema: dict[str, Any]) -> str | None:
    named = schema.get("$schema")
    validator = jsonschema.validators.validator_for(
        schema if isinstance(named, str) else {}, default=jsonschema.Draft202012Validator
    )
    error = jsonschema.exceptions.best_match(_metaschema_validator(validator).iter_errors(schema))
    return None if error is None else f"at {error.json_path}: {error.message}"[:300]


@functools.cache
def _metaschema_validator(validator: Any) -> Any:
    """A validator of schemas of `validator`'s draft (built once: building one costs more than
    checking a schema)."""
    return validator(validator.META_SCHEMA)
