"""TOML tables -> attrs classes, with errors that name the dotted key.

The generic structurer behind run configs and components' options: an unknown key lists the
allowed ones (and suggests the closest), a value of the wrong type says what was expected.
"""

from __future__ import annotations

import contextlib
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from plait.errors import ConfigError, did_you_mean

_SCALARS: dict[Any, str] = {
    float: "a number",
    int: "an integer",
    bool: "true or false",
    str: "a string",
}


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check (and lightly coerce) `value` against the type annotation `tp`."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        if value not in args:
            raise ConfigError(
                path,
                f"{value!r} is not one of {', '.join(repr(a) for a in args)}"
                + did_you_mean(str(value), [str(a) for a in args]),
            )
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1 and attrs.has(others[0]):  # an optional table: its own error says more
            return _convert(others[0], value, path)
        for arg in others:
            with contextlib.suppress(ConfigError):
                return _convert(arg, value, path)
        raise ConfigError(path, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(path, f"expected a list, got {type(value).__name__} {value!r}")
        item_type = args[0] if args else Any
        items = [_convert(item_type, v, _join(path, i)) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a table, got {type(value).__name__} {value!r}")
        value_type = args[1] if len(args) == 2 else Any
        return {str(k): _convert(value_type, v, _join(path, str(k))) for k, v in value.items()}
    if attrs.has(tp):
        return structure(tp, value, path)
    if tp in _SCALARS:
        accepted = int | float if tp is float else tp  # a float takes an int too
        # bool is a subclass of int, so a bool is taken only where a bool is expected
        if isinstance(value, bool) != (tp is bool) or not isinstance(value, accepted):
            raise ConfigError(
                path, f"expected {_SCALARS[tp]}, got {type(value).__name__} {value!r}"
            )
        return float(value) if tp is float else value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(path, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def structure(cls: type, data: Any, path: str = "") -> Any:
    """Build attrs class `cls` from a TOML table, with errors that name `path.key`."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a table, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in attrs.fields(cls)}
    for key in data:
        if key not in fields:
            raise ConfigError(
                _join(path, key),
                f"unknown key{did_you_mean(str(key), fields)}; allowed keys: {', '.join(fields)}",
            )
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name))
        elif field.default is attrs.NOTHING:
            raise ConfigError(_join(path, name), "required key is missing")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(path, str(exc)) from exc


def structure_options(cls: type | None, data: Mapping[str, Any], path: str) -> Any:
    """A component's options: its options class, or {} when it takes none."""
    if cls is None:
        if data:
            raise ConfigError(_join(path, next(iter(data))), "this component takes no options")
        return None
    return structure(cls, data, path)


def unstructure(obj: Any) -> Any:
    """The TOML-able dict of a config object (what `structure` takes back)."""
    return attrs.asdict(obj, recurse=True, filter=lambda _a, v: v is not None)


def positive(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def non_negative(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")
