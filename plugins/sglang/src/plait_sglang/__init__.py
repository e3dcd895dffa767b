"""plait's SGLang inference engine (see README.md). Importing this package imports no SGLang."""

from __future__ import annotations

__all__ = ["SGLangEngine", "SGLangOptions"]


def __getattr__(name: str):  # lazy: plugin discovery imports only plait_sglang.plugin
    if name == "SGLangEngine":
        from plait_sglang.engine import SGLangEngine

        return SGLangEngine
    if name == "SGLangOptions":
        from plait_sglang.options import SGLangOptions

        return SGLangOptions
    raise AttributeError(name)
