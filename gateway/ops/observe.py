"""The outermost ASGI layer: gives each HTTP request an id, counts it by route and status, and writes
one structlog line when it ends, with whatever the route added (token counts, finish reasons).

It wraps the whole Litestar app, so unknown routes, 413s and auth refusals are counted and logged too.
Routes add fields with `annotate(...)`; the fields live in a context variable, which the streaming
task Litestar starts for a response body inherits.
"""

from __future__ import annotations

import secrets
import time
from contextvars import ContextVar
from typing import Any

import structlog
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.ops.metrics import Metrics

log = structlog.get_logger("ctxfuse.gateway")

_fields: ContextVar[dict[str, Any] | None] = ContextVar("ctxfuse_request_fields", default=None)
_request_id: ContextVar[str] = ContextVar("ctxfuse_request_id", default="")


def annotate(**fields: Any) -> None:
    """Add fields to the current request's log line."""
    current = _fields.get()
    if current is not None:
        current.update(fields)


def request_id() -> str:
    """The id of the request being served (also in the `x-request-id` response header)."""
    return _request_id.get() or secrets.token_hex(16)


class Observe:
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = secrets.token_hex(16)
        fields: dict[str, Any] = {}
        _fields.set(fields)
        _request_id.set(rid)
        status = 0
        start = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            # status 0: the client went away before any response (nginx logs this as 499)
            code = str(status or 499)
            route = scope.get("path_template") or "unmatched"
            self.metrics.http_requests.labels(route=route, status=code).inc()
            principal = scope.get("state", {}).get("principal")  # set by authentication (access/auth.py)
            if principal is not None and not route.startswith(_CONSOLE):  # the operator's page: not usage
                self.metrics.tenant_requests.labels(tenant=principal.tenant, status=code).inc()
            if route not in _QUIET_ROUTES or status >= 400:
                log.info(
                    "request",
                    request_id=rid,
                    method=scope.get("method", ""),
                    path=scope["path"],
                    status=int(code),
                    duration_ms=round((time.perf_counter() - start) * 1000, 2),
                    **fields,
                )


# probes and scrapes would drown the log; they are still counted
_QUIET_ROUTES = frozenset(
    {"/health", "/ready", "/metrics", "/internal/v1/state", "/internal/v1/blocks", "/console/api/snapshot"}
)
_CONSOLE = "/console"
