"""structlog set-up shared by the CLI, the controller and the plugins."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def ensure_configured() -> None:
    """Configure logging once (level from PLAIT_LOG_LEVEL, default info) unless someone already did."""
    if not structlog.is_configured():
        configure(os.environ.get("PLAIT_LOG_LEVEL", "info"))


def configure(level: str = "info", *, json: bool = False) -> None:
    """Human-readable logs on stderr (or JSON lines with `json=True`)."""
    numeric = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
