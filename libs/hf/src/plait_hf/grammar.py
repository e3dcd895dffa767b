"""Grammars of tool calls: "a call to one of these tools, with arguments that match their JSON
schemas", written in the tool-call formats of `plait_hf.formats`.

The dialect is GBNF/EBNF as xgrammar reads it (`root ::= ...`): vLLM's structured outputs
(`structured_outputs.grammar`) and SGLang's `ebnf` sampling parameter compile it with xgrammar,
and llguidance (plait-torch) reads it through its GBNF converter. Only the constructs those three
share are written: string literals, character classes, `|`, `( )`, `?`, `*`, `{m,n}`.

The arguments are written as the chat templates write them (`json.dumps`: `", "` and `": "`,
properties in schema order), so a constrained call renders back to the very tokens it was sampled
as. Supported JSON Schema: `type` (one or a list), `enum`, `const`, `properties` / `required`,
`items` with `minItems` / `maxItems`, `minLength` / `maxLength`, `anyOf` / `oneOf`, local
`$ref`s into `$defs` / `definitions`. Anything else (`pattern`, `format`, `minimum`, ...) is not
enforced: a value of the right type is accepted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from plait.api import ToolSpec
from plait_hf.formats import THINK_CLOSE, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCallFormat, to_json

_JSON_VALUE_RULES = r"""
json_value ::= json_object | json_array | json_string | json_number | "true" | "false" | "null"
json_object ::= "{" ( json_string ": " json_value ( ", " json_string ": " json_value )* )? "}"
json_array ::= "[" ( json_value ( ", " json_value )* )? "]"
json_string ::= "\"" json_char* "\""
json_char ::= [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4,4} )
json_integer ::= "-"? ( "0" | [1-9] [0-9]* )
json_number ::= json_integer ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
xml_char ::= [^<\n]
""".strip()


def literal(text: str) -> str:
    """`text` as a grammar string literal."""
    escaped = []
    for char in text:
        if char in '"\\':
            escaped.append("\\" + char)
        elif char == "\n":
            escaped.append("\\n")
        elif char == "\t":
            escaped.append("\\t")
        elif char == "\r":
            escaped.append("\\r")
        elif ord(char) < 0x20:
            escaped.append(f"\\x{ord(char):02x}")
        else:
            escaped.append(char)
    return '"' + "".join(escaped) + '"'


def _repeat(item: str, low: int, high: int | None) -> str:
    """`item` repeated low..high times (high None: unbounded)."""
    if high is None:
        return f"{item}*" if low == 0 else f"{item}{{{low},}}"
    return f"{item}{{{low},{high}}}"


class _Rules:
    """Turns JSON schemas into named rules (one per schema node, named after where it sits)."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}

    def add(self, path: str, body: str) -> str:
        base = re.sub(r"[^a-z0-9]+", "_", path.lower()).strip("_")
        name, k = base, 1
        while name in self.rules:
            k += 1
            name = f"{base}_{k}"
        self.rules[name] = body
        return name

    def value(self, schema: Any, root: Mapping[str, Any], path: str, *, text: bool = False) -> str:
        """The rule of a value that matches `schema` (`root` holds its `$defs`). `text`: a Qwen3.5
        XML parameter, whose strings go unquoted (and everything else as JSON)."""
        name = self.add(path, "")  # named before its body is built: a $ref may recurse to it
        self.rules[name] = self._body(schema, root, path, text)
        return name

    def _body(self, schema: Any, root: Mapping[str, Any], path: str, text: bool) -> str:
        if not isinstance(schema, Mapping) or not schema:
            return "json_value"  # `true` or `{}`: any value
        if "$ref" in schema:
            return self.value(resolve_ref(schema["$ref"], root), root, f"{path}_ref", text=text)
        if "const" in schema:
            return _value_literal(schema["const"], text)
        if "enum" in schema:
            return " | ".join(_value_literal(v, text) for v in schema["enum"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                return " | ".join(
                    self.value({**rest, **option}, root, f"{path}_{i}", text=text)
                    for i, option in enumerate(schema[key])
                )
        kind = schema.get("type")
        if isinstance(kind, list):
            return " | ".join(
                self.value({**schema, "type": t}, root, f"{path}_{t}", text=text) for t in kind
            )
        if kind == "string":
            low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
            if text:
                return _repeat("xml_char", low, high)
            return f'"\\"" {_repeat("json_char", low, high)} "\\""'
        simple = {
            "integer": "json_integer",
            "number": "json_number",
            "boolean": '"true" | "false"',
            "null": '"null"',
        }
        if kind in simple:
            return simple[kind]
        if kind == "array":
            return self._array(schema, root, path)
        if kind == "object" or "properties" in schema:
            return self._object(schema, root, path)
        return "json_value"

    def _array(self, schema: Mapping[str, Any], root: Mapping[str, Any], path: str) -> str:
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) == 0:
            return '"[]"'
        item = self.value(schema.get("items", {}), root, f"{path}_item")
        items = f"{item} " + _repeat(
            f'( ", " {item} )', max(low - 1, 0), None if high is None else int(high) - 1
        )
        return f'"[" {items} "]"' if low > 0 else f'"[" ( {items} )? "]"'

    def _object(self, schema: Mapping[str, Any], root: Mapping[str, Any], path: str) -> str:
        properties: Mapping[str, Any] = schema.get("properties") or {}
        if not properties:
            return '"{}"' if schema.get("additionalProperties") is False else "json_object"
        required = set(schema.get("required", ()))
        pairs = [
            (
                key in required,
                f"{literal(to_json(key) + ': ')} {self.value(sub, root, f'{path}_{key}')}",
            )
            for key, sub in properties.items()
        ]
        # Properties go in schema order (as the templates' json.dumps writes them), each optional
        # one there or not. `later` matches properties k.. once one was written (commas first),
        # `first` the same before any was; None where nothing can follow.
        later: str | None = None
        first: str | None = None
        for k in range(len(pairs) - 1, -1, -1):
            is_required, pair = pairs[k]
            here = f"{pair} {later}" if later else pair
            if is_required:
                first = here
            elif first is None:
                first = f"( {here} )?"
            else:
                first = self.add(f"{path}_from_{k}", f"{here} | {first}")
            if k > 0:  # the first property is never preceded by another
                step = f'", " {pair}' if is_required else f'( ", " {pair} )?'
                later = self.add(f"{path}_after_{k}", f"{step} {later}" if later else step)
        return f'"{{" {first} "}}"'


def resolve_ref(ref: str, root: Mapping[str, Any]) -> Any:
    """The schema a local `$ref` (`#/$defs/X` or `#/definitions/X`) points at."""
    match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref)
    if match is None or match.group(2) not in root.get(match.group(1), {}):
        raise ValueError(f"JSON schema $ref {ref!r}: only local refs into $defs are supported")
    return root[match.group(1)][match.group(2)]


def _value_literal(value: Any, text: bool) -> str:
    return literal(value if text and isinstance(value, str) else to_json(value))


def _is_text(schema: Any) -> bool:
    """A parameter that Qwen3.5 writes unquoted: a string, or one of some strings."""
    if not isinstance(schema, Mapping):
        return False
    if "enum" in schema:
        return all(isinstance(v, str) for v in schema["enum"])
    return schema.get("type") == "string"


def tool_call_grammar(
    tools: Sequence[ToolSpec],
    fmt: ToolCallFormat,
    *,
    parallel: bool = True,
    after_open_reasoning: bool = False,
) -> str:
    """The grammar of a response that is nothing but tool calls in format `fmt`: one call (with
    `parallel`, one or more, separated as the template separates them) to one of `tools`, with
    arguments that match the tool's `input_schema`.

    `after_open_reasoning`: the generation prompt ends inside a `<think>` block; the response
    closes it at once (empty reasoning, as the templates write a turn without thinking)."""
    if not tools:
        raise ValueError("a tool-call grammar needs at least one tool")
    rules = _Rules()
    calls = []
    for index, tool in enumerate(tools):
        schema = tool.input_schema or {"type": "object", "properties": {}}
        if fmt == "json":
            arguments = rules.value(schema, schema, f"t{index}_args")
            head = literal(f'{TOOL_CALL_OPEN}\n{{"name": {to_json(tool.name)}, "arguments": ')
            tail = literal("}\n" + TOOL_CALL_CLOSE)
            body = f"{head} {arguments} {tail}"
        else:
            body = _xml_call(tool.name, schema, rules, f"t{index}")
        calls.append(rules.add(f"t{index}_call", body))
    calls_rule = 'call ( "\\n" call )*' if parallel else "call"
    close = literal(f"\n{THINK_CLOSE}\n\n") + " " if after_open_reasoning else ""
    lines = [
        f"root ::= {close}{calls_rule}",
        f"call ::= {' | '.join(calls)}",
        *(f"{name} ::= {body}" for name, body in rules.rules.items()),
        _JSON_VALUE_RULES,
    ]
    return "\n".join(lines) + "\n"


def _xml_call(name: str, schema: Mapping[str, Any], rules: _Rules, path: str) -> str:
    """`<function=NAME>` and a `<parameter=KEY>` block per property in schema order, optional ones
    there or not (Qwen3.5's parser reads them in any order; the grammar allows one)."""
    properties: Mapping[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required", ()))
    parts = [literal(f"{TOOL_CALL_OPEN}\n<function={name}>\n")]
    for key, sub in properties.items():
        if isinstance(sub, Mapping) and "$ref" in sub:
            sub = resolve_ref(sub["$ref"], schema)
        value = rules.value(sub, schema, f"{path}_{key}", text=_is_text(sub))
        open_, close = literal(f"<parameter={key}>\n"), literal("\n</parameter>\n")
        block = f"{open_} {value} {close}"
        parts.append(block if key in required else f"( {block} )?")
    parts.append(literal(f"</function>\n{TOOL_CALL_CLOSE}"))
    return " ".join(parts)
