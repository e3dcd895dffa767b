"""What the two OpenAI wire formats (`openai_chat`, `openai_responses`) share: reading a request
field by field with errors that name the field, the sampling options, tool-call arguments, the
error shape, per-token logprobs and SSE frames."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from plait.api import ToolCall, ToolSpec
from plait_proxy.chat import Choice, RequestError, tool_schema_problem
from plait_sdk.server import parse_json

MAX_JSON_DEPTH = 64
"""How deep tool-call arguments may nest (as deep as the HTTP app lets a body nest)."""

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "rate_limit_error",
        "api_error",
        "server_error",
    }
)


def error_body(error: RequestError) -> dict[str, Any]:
    """OpenAI's error shape; a `kind` that is not an error type (e.g. "context_length_exceeded")
    is OpenAI's `code` of an invalid request."""
    if error.kind in _ERROR_TYPES:
        kind, code = error.kind, None
    else:
        kind, code = ("invalid_request_error" if error.status < 500 else "server_error"), error.kind
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


def json_type(value: Any) -> str:
    """How an error message names the JSON type a client sent."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object" if isinstance(value, dict) else type(value).__name__


def checked_text(value: str, param: str) -> str:
    """`value`, if it can be written back out: JSON's \\ud800-style escapes can smuggle in lone
    surrogates, which no UTF-8 encoder (the tokenizer's, the response's) accepts."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(
            f"`{param}` holds a lone UTF-16 surrogate: send valid Unicode text", param=param
        ) from None
    return value


def checked_json(value: Any, param: str) -> Any:
    """`value` (a parsed JSON object), if it can be rendered into a prompt and echoed back."""
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, TypeError, RecursionError):  # surrogates, NaN, nesting past the stack
        raise RequestError(
            f"`{param}` is not plain JSON (lone surrogates, NaN or nesting too deep): "
            "send standard JSON",
            param=param,
        ) from None
    return value


class Fields:
    """One JSON object of a request, read field by field. A field of the wrong type or out of
    range is a RequestError naming its path; null reads as absent, as SDKs send unset fields."""

    def __init__(self, value: Any, path: str = "") -> None:
        if not isinstance(value, dict):
            where = f"`{path}`" if path else "the request body"
            raise RequestError(
                f"{where} must be a JSON object, got {json_type(value)}", param=path or None
            )
        self.value: dict[str, Any] = value
        self.path = path

    def param(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str) -> Any:
        return self.value.get(key)

    def fail(self, key: str, expected: str) -> RequestError:
        return RequestError(
            f"`{self.param(key)}` must be {expected}, got {json_type(self.get(key))}",
            param=self.param(key),
        )

    def required(self, key: str, expected: str) -> Any:
        if self.get(key) is None:
            raise RequestError(
                f"`{self.param(key)}` is required: send {expected}", param=self.param(key)
            )
        return self.get(key)

    def required_obj(self, key: str) -> Fields:
        return Fields(self.required(key, "an object"), self.param(key))

    def text(self, key: str) -> str | None:
        value = self.get(key)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.fail(key, "a string")
        return checked_text(value, self.param(key))

    def required_text(self, key: str) -> str:
        self.required(key, "a string")
        text = self.text(key)
        assert text is not None
        return text

    def choice(self, key: str, options: Sequence[str]) -> str | None:
        value = self.get(key)
        if value is None:
            return None
        if value not in options:
            allowed = ", ".join(f'"{o}"' for o in options)
            raise RequestError(
                f"`{self.param(key)}` must be one of {allowed}", param=self.param(key)
            )
        return str(value)

    def flag(self, key: str) -> bool | None:
        value = self.get(key)
        if value is not None and not isinstance(value, bool):
            raise self.fail(key, "true or false")
        return value

    def integer(self, key: str, low: int, high: int) -> int | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 16.0 from a client that only has doubles
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise self.fail(key, f"an integer from {low} to {high}")
        return value

    def number(self, key: str, low: float, high: float) -> float | None:
        value = self.get(key)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high
        ):
            raise self.fail(key, f"a number from {low:g} to {high:g}")  # NaN fails the range too
        return float(value)

    def items(self, key: str) -> list[Any] | None:
        value = self.get(key)
        if value is not None and not isinstance(value, list):
            raise self.fail(key, "a list")
        return value

    def obj(self, key: str) -> Fields | None:
        value = self.get(key)
        return None if value is None else Fields(value, self.param(key))

    def string_map(self, key: str) -> dict[str, str] | None:
        """An object of strings, such as `metadata` (echoed back, where SDKs expect strings)."""
        fields = self.obj(key)
        if fields is None:
            return None
        for name, value in fields.value.items():
            checked_text(name, fields.param(name))
            if not isinstance(value, str):
                raise fields.fail(name, "a string")
            checked_text(value, fields.param(name))
        return fields.value

    def refuse_unless(self, key: str, allowed: Any, why: str) -> None:
        """An option the proxy cannot honour: absent, null or `allowed` pass, anything else is a
        400 saying `why`."""
        value = self.get(key)
        if value is not None and value != allowed:
            raise RequestError(
                f"`{self.param(key)}` is not supported: {why}", param=self.param(key)
            )


def common_options(fields: Fields, max_tokens_keys: Sequence[str]) -> dict[str, Any]:
    """The ChatRequest sampling fields both APIs spell alike, without the ones the client left
    out (the ChatRequest defaults then apply). `max_tokens_keys`: the API's names for the limit,
    the preferred one first."""
    limits = [fields.integer(key, 1, INT32_MAX) for key in max_tokens_keys]
    options: dict[str, Any] = {
        "max_tokens": next((limit for limit in limits if limit is not None), None),
        "temperature": fields.number("temperature", 0, 2),
        "top_p": fields.number("top_p", 0, 1),
        "stream": fields.flag("stream"),
        "parallel_tool_calls": fields.flag("parallel_tool_calls"),
    }
    if options["top_p"] == 0:
        raise RequestError(
            "`top_p` must be above 0: send temperature 0 for greedy sampling", param="top_p"
        )
    fields.flag("store")
    fields.text("user")
    fields.string_map("metadata")
    fields.refuse_unless(
        "top_logprobs",
        0,
        "the engine reports only the sampled token's logprob; send 0 or leave it out",
    )
    return {key: value for key, value in options.items() if value is not None}


def parse_arguments(value: Any, param: str) -> dict[str, Any]:
    """A tool call's arguments: a JSON string that holds an object ("" reads as no arguments)."""
    if not isinstance(value, str):
        raise RequestError(
            f"`{param}` must be a string of JSON (json.dumps of the arguments object), "
            f"got {json_type(value)}",
            param=param,
        )
    if not value.strip():
        return {}
    try:
        arguments = parse_json(value, MAX_JSON_DEPTH)
    except ValueError as exc:
        raise RequestError(
            f"`{param}` is not valid JSON ({exc}): send json.dumps of the arguments object",
            param=param,
        ) from None
    if not isinstance(arguments, dict):
        raise RequestError(
            f"`{param}` must encode a JSON object, got {json_type(arguments)}", param=param
        )
    checked_json(arguments, param)
    return arguments


def read_tools(fields: Fields, function_of: Callable[[Fields], Fields]) -> tuple[ToolSpec, ...]:
    """The request's `tools`, function tools only; `function_of` finds the object that holds a
    tool's name, description and parameters (the tool itself, or its `function`)."""
    specs: list[ToolSpec] = []
    for i, item in enumerate(fields.items("tools") or []):
        tool = Fields(item, f"tools[{i}]")
        kind = tool.get("type")
        if kind != "function":
            named = f'"{kind[:40]}"' if isinstance(kind, str) else json_type(kind)
            raise RequestError(
                f"only function tools are supported and `{tool.param('type')}` is {named}: "
                'send {"type": "function", ...} tools',
                param=tool.param("type"),
            )
        function = function_of(tool)
        name = function.required_text("name")
        if any(spec.name == name for spec in specs):
            raise RequestError(
                f"two tools are named {name!r}: tool names must be unique",
                param=function.param("name"),
            )
        parameters = function.obj("parameters")
        schema = None if parameters is None else checked_tool_schema(parameters)
        specs.append(ToolSpec(name, function.text("description") or "", schema))
    return tuple(specs)


def checked_tool_schema(parameters: Fields) -> dict[str, Any]:
    """A tool's `parameters`, if they are a JSON Schema of an object."""
    schema = checked_json(parameters.value, parameters.path)
    problem = tool_schema_problem(schema)
    if problem is not None:
        raise RequestError(
            f"`{parameters.path}` is not a valid JSON Schema of an object ({problem}): send the "
            'schema of the arguments, e.g. {"type": "object", "properties": {...}}',
            param=parameters.path,
        )
    return schema


def pick_tool(name: str, tools: Sequence[ToolSpec], param: str) -> str:
    """A tool choice that names a tool: it must be one of the request's tools."""
    if name not in {tool.name for tool in tools}:
        offered = ", ".join(repr(tool.name) for tool in tools) or "none"
        raise RequestError(
            f"`{param}` names {name!r}, which is not among `tools` (offered: {offered})",
            param=param,
        )
    return name


def read_tool_choice(
    fields: Fields,
    tools: Sequence[ToolSpec],
    name_holder: Callable[[Fields], Fields],
    named_form: str,
) -> str:
    """ChatRequest.tool_choice from `tool_choice`: a mode, or the name of one of `tools`, which
    `name_holder` finds in the API's named form (`named_form`, for the error message)."""
    value = fields.get("tool_choice")
    if value is None:
        return "auto"
    if isinstance(value, dict):
        choice = Fields(value, "tool_choice")
        if choice.get("type") == "function":
            holder = name_holder(choice)
            return pick_tool(holder.required_text("name"), tools, holder.param("name"))
    elif isinstance(value, str) and value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise RequestError(
                '`tool_choice` "required" needs `tools`: send tools or leave it out',
                param="tool_choice",
            )
        return value
    raise RequestError(
        f'`tool_choice` must be "auto", "none", "required" or {named_form}', param="tool_choice"
    )


def unknown_call(identifier: str, param: str, calls: str) -> RequestError:
    """A tool result whose call id no earlier call of the conversation (`calls`: where the API
    puts them) has: there is no call for the model to see it answer."""
    return RequestError(
        f"`{param}` is {identifier[:80]!r}, which no earlier {calls} of the conversation has: "
        "send the result with the id of the tool call it answers",
        param=param,
    )


def call_id(call: ToolCall, completion_id: str, choice_index: int, k: int) -> str:
    """The id a tool call goes out with (the proxy gives every call one; a renderer may not)."""
    return call.id or f"call_{completion_id}_{choice_index}_{k}"


def dump_arguments(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def text_parts(value: Any, param: str, text_types: Sequence[str]) -> str:
    """Message content: a string, or a list of text parts (of `text_types`), joined by newlines
    as vLLM joins them for a chat template."""
    if isinstance(value, str):
        return checked_text(value, param)
    if not isinstance(value, list):
        raise RequestError(
            f"`{param}` must be a string or a list of text parts, got {json_type(value)}",
            param=param,
        )
    texts = []
    for i, part in enumerate(value):
        fields = Fields(part, f"{param}[{i}]")
        kind = fields.get("type")
        if kind not in text_types:
            named = (
                f'"{kind[:40]}" parts are'
                if isinstance(kind, str)
                else "a part without a string `type` is"
            )
            raise RequestError(
                f"only text content is supported and {named} not: send "
                f"{' or '.join(f'{t!r}' for t in text_types)} parts",
                param=fields.param("type"),
            )
        texts.append(fields.required_text("text"))
    return "\n".join(texts)


def token_logprobs(choice: Choice) -> list[dict[str, Any]]:
    """One entry per sampled token (every token the engine sampled, reasoning and tool-call
    markup included: what a trainer sees), in OpenAI's shape."""
    texts = choice.token_texts or ("",) * len(choice.sequence.logprobs)
    return [
        {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
        for text, logprob in zip(texts, choice.sequence.logprobs, strict=False)
    ]


def pieces(text: str, size: int = 48) -> Iterator[str]:
    """`text` in stream-sized deltas (the engine returns whole sequences; clients want several)."""
    for start in range(0, len(text), size):
        yield text[start : start + size]


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
