"""structlog set-up shared by the CLI, the controller and the plugins."""

from __future__ import annotations

import logging
import os
import sys

import structlog
from rich.console import Console

# One stderr console for progress bars, step summaries and log lines, so that they do not collide.
console = Console(stderr=True, highlight=False, emoji=False)  # ids such as "s:train:0" stay text


class _ConsoleLogger:
    """A structlog logger that prints through the shared console (above any progress bar)."""

    def msg(self, message: str) -> None:
        console.print(message, markup=False, highlight=False, soft_wrap=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def ensure_configured() -> None:
    """Configure logging once (level from PLAIT_LOG_LEVEL, default info) unless someone already
    did."""
    if not structlog.is_configured():
        configure_logging(os.environ.get("PLAIT_LOG_LEVEL", "info"))


def configure_logging(level: str = "info", *, json: bool = False) -> None:
    """Human-readable logs on stderr (or JSON lines with `json=True`)."""
    numeric = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(message)s")
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=console.is_terminal)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *args: _ConsoleLogger(),
        cache_logger_on_first_use=False,
    )
