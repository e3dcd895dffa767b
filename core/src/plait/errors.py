"""Errors a user can cause. Each names its cause and, where one exists, the fix.

The CLI prints these as two short lines without a traceback (set PLAIT_TRACEBACK=1 for one).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class PlaitError(Exception):
    """Base class of every error plait raises on purpose."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\n  fix: {self.fix}"


class ConfigError(PlaitError):
    """A config value or key is wrong; the message starts with its dotted path."""

    def __init__(self, path: str, problem: str, *, fix: str | None = None) -> None:
        super().__init__(f"config {path}: {problem}" if path else f"config: {problem}", fix=fix)
        self.path = path


class PluginError(PlaitError):
    """A plugin failed to load, registers something twice, or implements an unknown hook."""


class UnknownComponentError(PlaitError):
    """A config names a component (engine, env, renderer, ...) no installed plugin registers."""


class ModelError(PlaitError):
    """A model cannot be found, loaded or converted, or does not fit its tokenizer."""


class DataError(PlaitError, ValueError):
    """Training or sampling input that does not fit the model or the loss (missing loss inputs,
    token ids outside the vocabulary, empty prompts). A ValueError too, for callers that catch
    those."""


class EngineError(PlaitError):
    """An engine is unreachable, crashed, or answered something it should not have."""


class RendererError(PlaitError):
    """A renderer raised: a bug in plait's own parts, which stops the run (never one episode's)."""


class WeightSyncError(PlaitError):
    """A weight transfer failed, timed out, or arrived corrupted."""


class EnvironmentError_(PlaitError):
    """An environment failed in a way that costs the current trajectory."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean "x"?)' when a close match exists, else ''."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f' (did you mean "{match[0]}"?)' if match else ""
