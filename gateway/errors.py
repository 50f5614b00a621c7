"""Every failure leaves the gateway in OpenAI's error shape, from the one hierarchy in shared.errors.

Litestar's own exceptions (unknown route, wrong method, body over the limit) are mapped onto it too,
so a client never sees two error formats. Anything unexpected is a 500 that hides the internals.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import structlog
from litestar import Request, Response
from litestar.exceptions import HTTPException
from litestar.status_codes import HTTP_413_REQUEST_ENTITY_TOO_LARGE

from gateway.encoding import encode
from shared.errors import CtxfuseError, InvalidRequestError, NotFoundError, QueueFullError
from shared.storage_faults import fault_from

log = structlog.get_logger("ctxfuse.gateway")


class ServiceUnavailableError(CtxfuseError):
    """The gateway is starting or draining and takes no new work (503)."""

    status = 503
    type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="service_unavailable")


class AuthenticationError(CtxfuseError):
    status = 401
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="invalid_api_key")


class PermissionDeniedError(CtxfuseError):
    """The caller is known but may not do this (403), e.g. a key limited to other models."""

    status = 403
    type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message, param=param, code="permission_denied")


class RateLimitError(QueueFullError):
    """A key's requests or tokens per minute, or requests in flight, are used up (429 with
    Retry-After, as OpenAI's rate_limit_exceeded)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.code = "rate_limit_exceeded"


class RequestTooLargeError(InvalidRequestError):
    status = 413


class ConflictError(CtxfuseError):
    """The object is in a state that does not allow the operation (409), e.g. cancelling a done batch."""

    status = 409
    type = "invalid_request_error"


class IdempotencyKeyReusedError(CtxfuseError):
    """An Idempotency-Key sent again with a different request (422): the key names the first one."""

    status = 422
    type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__(
            "this Idempotency-Key was already used with a different request; send a new key for a new "
            "request, or the same request to get its first result",
            code="idempotency_key_reused",
        )


def error_response(exc: CtxfuseError) -> Response[bytes]:
    headers: dict[str, str] = {}
    retry_after_s = getattr(exc, "retry_after_s", None)  # a full queue or disk: when to come back
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return Response(
        encode(exc.to_openai()), status_code=exc.status, media_type="application/json", headers=headers
    )


def _from_http(exc: HTTPException) -> CtxfuseError:
    if exc.status_code == HTTP_413_REQUEST_ENTITY_TOO_LARGE:
        return RequestTooLargeError("the request body is larger than this server accepts", code="too_large")
    if exc.status_code == 404:
        return NotFoundError("no such route; see /schema for the API", code="not_found")
    err = CtxfuseError(str(exc.detail))
    err.status = exc.status_code
    err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return err


def handle_ctxfuse_error(_: Request[Any, Any, Any], exc: CtxfuseError) -> Response[bytes]:
    return error_response(exc)


def handle_http_exception(_: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    return error_response(_from_http(exc))


def handle_unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    log.exception("unhandled_error", path=request.url.path)
    # a disk fault past every store's guard is still answered as one (507 or 503), never a 500
    fault = fault_from(exc, "server", Path(request.url.path))
    if fault is not None:
        return error_response(fault)
    return error_response(CtxfuseError("the server failed on this request; it has been logged"))


EXCEPTION_HANDLERS = {
    CtxfuseError: handle_ctxfuse_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
