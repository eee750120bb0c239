"""arbiterd's errors as the HTTP edge answers them: the one mapping from an exception to OpenAI's
error envelope `{"error": {"message", "type", "code", "param"}}` and its status (app.py's routes
and streams.py's streams both answer through it), never a 500 for bad input, never a bare
string."""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.requests import ClientDisconnect

from arbiterd.daemon.http.openai_requests import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    SERVER_ERROR,
    ApiError,
)
from arbiterd.errors import (
    ArbiterError,
    ErrorCode,
    QueueTimeoutError,
    UnknownModelError,
)

log = logging.getLogger(__name__)


def unknown_model(model: str, names: list[str]) -> ApiError:
    available = ", ".join(names) if names else "none"
    return ApiError(
        404,
        f"The model {model!r} does not exist; available models: {available}",
        code="model_not_found",
        param="model",
    )


# OpenAI's error codes for ours; any other is "invalid_value" below 500, "model_unavailable" above.
# The HTTP status of every arbiterd error is errors.OUTCOMES's.
OPENAI_CODES: dict[ErrorCode, str] = {
    ErrorCode.CONTEXT_OVERFLOW: "context_length_exceeded",
    ErrorCode.INTERNAL: INTERNAL_ERROR,
    ErrorCode.SHUTTING_DOWN: "shutting_down",
}


def api_error(exc: Exception, names: Callable[[], list[str]]) -> ApiError:
    """The one mapping from an exception to an HTTP error; unexpected ones are logged."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ClientDisconnect):
        return client_left()
    if isinstance(exc, UnknownModelError):
        available = ", ".join(names()) or "none"
        return ApiError(
            404, f"{exc}; available models: {available}", code="model_not_found", param="model"
        )
    if isinstance(exc, ArbiterError):
        status = exc.http_status
        fallback = "invalid_value" if status < 500 else "model_unavailable"
        retry = exc.retry_after_s if isinstance(exc, QueueTimeoutError) else None
        return ApiError(
            status,
            str(exc),
            type_=INVALID_REQUEST if status < 500 else SERVER_ERROR,
            code=OPENAI_CODES.get(exc.code, fallback),
            headers=None if retry is None else {"retry-after": str(retry)},
        )
    log.error("unexpected error serving a request", exc_info=exc)
    return internal_error()


def internal_error() -> ApiError:
    return ApiError(
        500,
        "internal error; the daemon's log has the details",
        type_=SERVER_ERROR,
        code=INTERNAL_ERROR,
    )


def client_left() -> ApiError:
    # Nobody reads this; the status is for the access log (nginx's "client closed request").
    return ApiError(499, "the client closed the request")
