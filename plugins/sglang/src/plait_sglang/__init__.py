"""plait's SGLang inference engine (see README.md). Importing this package imports no SGLang."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plait_sglang.engine import SGLangEngine
    from plait_sglang.options import SGLangOptions

__all__ = ["SGLangEngine", "SGLangOptions"]


def __getattr__(name: str) -> type:  # lazy: plugin discovery imports only plait_sglang.plugin
    if name == "SGLangEngine":
        from plait_sglang.engine import SGLangEngine

        return SGLangEngine
    if name == "SGLangOptions":
        from plait_sglang.options import SGLangOptions

        return SGLangOptions
    raise AttributeError(name)
