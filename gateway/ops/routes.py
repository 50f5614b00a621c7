"""Operational routes, the same over any upstream: liveness, readiness and Prometheus metrics
(open even when API keys are required)."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get

from gateway.encoding import encode
from gateway.ops.metrics import CONTENT_TYPE
from gateway.state import Gateway
from shared.service_protocol import Health

JSON = "application/json"


def _gw(request: Request[Any, Any, Any]) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


@get("/health", summary="Liveness: the process answers and its engine runs (503 once the engine died)")
async def health(request: Request[Any, Any, Any]) -> Response[bytes]:
    # a dead engine never recovers in this process: 503 tells a supervisor or the fleet router to
    # restart or route around it (vLLM answers the same); draining is not dead, so it stays 200
    dead = _gw(request).upstream.dead_reason()
    status = Health(status="ok" if dead is None else dead)
    return Response(encode(status), media_type=JSON, status_code=200 if dead is None else 503)


@get("/ready", summary="Readiness: new requests are accepted (a model loaded, or a backend up)")
async def ready(request: Request[Any, Any, Any]) -> Response[bytes]:
    reason = _gw(request).not_ready_reason()
    status = Health(status="ready" if reason is None else reason)
    return Response(encode(status), media_type=JSON, status_code=200 if reason is None else 503)


@get("/metrics", summary="Prometheus metrics", include_in_schema=False)
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(_gw(request).metrics.render(), media_type=CONTENT_TYPE)


ROUTES = [health, ready, metrics]
