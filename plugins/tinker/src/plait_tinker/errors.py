"""How the Tinker service refuses a request: `ServiceError` with an HTTP status and the SDK's
error category, and the `{"error", "category"}` body the SDK raises as `RequestFailedError`."""

from __future__ import annotations

from typing import Any

import structlog

from plait.api import PlaitError

log = structlog.get_logger("plait_tinker")


class ServiceError(Exception):
    """A request refused or failed; `category` is the SDK's ("user": fix the request, "server")."""

    def __init__(self, message: str, *, status: int = 400, category: str = "user") -> None:
        super().__init__(message)
        self.message, self.status, self.category = message, status, category


def quota_exceeded(message: str) -> ServiceError:
    """403, not 429: both of the SDK's retry layers retry 408, 409, 429 and 5xx with backoff for
    minutes (tinker/_base_client.py, lib/internal_client_holder.py), so a 429 reaches the user as
    a hang; a 403 is raised at once with this message."""
    return ServiceError(message, status=403)


def not_found(what: str) -> ServiceError:
    return ServiceError(f"{what} not found", status=404)


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and `{"error", "category"}` body the SDK reads as a failed request."""
    if isinstance(exc, ServiceError):
        return exc.status, {"error": exc.message, "category": exc.category}
    if isinstance(exc, PlaitError | ValueError | KeyError):  # WireError included
        return 400, {"error": str(exc), "category": "user"}
    log.error("request failed", error=repr(exc))
    return 500, {"error": f"the server failed: {exc!r}", "category": "server"}
