"""Lazy targets: "module:attribute" strings that name an object without importing its module."""

from __future__ import annotations

import importlib
from typing import Any


def load_target(target: str) -> Any:
    """The object `target` ("package.module:Class.attribute") names, importing its module."""
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj
