"""The gateway in fleet mode (`ctxfuse serve --backend URL ...` or `--fleet fleet.toml`): the same
OpenAI routes, validated the same way, answered by the backends the fleet routes to. The OpenAI
error shape, API keys, request logs and /metrics are the gateway's own.

`GET /fleet/v1/backends` shows what the router knows: each backend's kind, version, circuit, load,
prefix keys, and the canary's state.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.response import Stream
from litestar.types import ASGIApp

from shared.protocol import ChatCompletionRequest, CompletionRequest, Health

from ..decode import decode_body
from ..disconnect import cancel_on_disconnect
from ..encoding import encode
from ..errors import EXCEPTION_HANDLERS
from ..metrics import Metrics
from ..observe import Observe
from .fleet import Fleet
from .health import check, run_checks
from .proxy import VERSION_HEADER, Outgoing, forward

AnyRequest = Request[Any, Any, Any]
JSON = "application/json"


def _fleet(request: AnyRequest) -> Fleet:
    fleet: Fleet = request.app.state.fleet
    return fleet


def _reports_blocks(fleet: Fleet) -> bool:
    return any(b.reports_blocks for b in fleet.backends)


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion (OpenAI), routed")
async def chat_completions(request: AnyRequest) -> Response[bytes] | Stream:
    fleet = _fleet(request)
    raw = await request.body()
    req = decode_body(raw, ChatCompletionRequest)  # a bad body is our 400, not a backend's
    keys = await asyncio.to_thread(fleet.keys.chat, req, _reports_blocks(fleet))
    out = Outgoing("/v1/chat/completions", raw, keys, request.headers.get(VERSION_HEADER))
    # a client gone before the answer: closing the backend request aborts the work there too
    return await cancel_on_disconnect(request.receive, forward(fleet, out))


@post("/v1/completions", status_code=200, summary="Create a completion (OpenAI, legacy), routed")
async def completions(request: AnyRequest) -> Response[bytes] | Stream:
    fleet = _fleet(request)
    raw = await request.body()
    req = decode_body(raw, CompletionRequest)
    keys = await asyncio.to_thread(fleet.keys.completion, req, _reports_blocks(fleet))
    out = Outgoing("/v1/completions", raw, keys, request.headers.get(VERSION_HEADER))
    return await cancel_on_disconnect(request.receive, forward(fleet, out))


@get("/v1/models", summary="List models (those the backends serve)")
async def models(request: AnyRequest) -> Response[bytes]:
    fleet = _fleet(request)
    for b in fleet.backends:
        if b.reachable and b.kind is not None:
            with contextlib.suppress(Exception):
                resp = await fleet.client.get(f"{b.url}/v1/models", timeout=5)
                if resp.status_code == 200:
                    return Response(resp.content, media_type=JSON)
    return Response(encode({"object": "list", "data": []}), media_type=JSON)


class BackendView(msgspec.Struct, kw_only=True):
    name: str
    url: str
    kind: str | None
    version: str
    circuit: str
    reachable: bool
    draining: bool
    in_flight: int
    load: float
    prefix_keys: int


class FleetView(msgspec.Struct, kw_only=True):
    policy: str
    backends: list[BackendView]
    versions: dict[str, str]  # version -> stable | canary | rolled_back
    weights: dict[str, float]


@get("/fleet/v1/backends", summary="What the router knows of each backend")
async def backends(request: AnyRequest) -> Response[bytes]:
    fleet = _fleet(request)
    view = FleetView(
        policy=fleet.config.policy,
        backends=[
            BackendView(
                name=b.name,
                url=b.url,
                kind=b.kind,
                version=b.spec.version,
                circuit=b.circuit.state,
                reachable=b.reachable,
                draining=b.draining,
                in_flight=b.in_flight,
                load=round(b.load(), 3),
                prefix_keys=fleet.index.held_by(b.name),
            )
            for b in fleet.backends
        ],
        versions={v: fleet.canary.state(v) for v in fleet.canary.versions},
        weights=fleet.canary.weights,
    )
    return Response(encode(view), media_type=JSON)


@get("/health", summary="Liveness")
async def health() -> Response[bytes]:
    return Response(encode(Health(status="ok")), media_type=JSON)


@get("/ready", summary="Readiness: some backend takes requests")
async def ready(request: AnyRequest) -> Response[bytes]:
    ok = any(b.takes_work() for b in _fleet(request).backends)
    body = Health(status="ready" if ok else "no backend takes requests")
    return Response(encode(body), media_type=JSON, status_code=200 if ok else 503)


def create_fleet_app(fleet: Fleet, metrics: Metrics, api_key: str | None, max_body_bytes: int) -> ASGIApp:
    task: asyncio.Task[None] | None = None

    async def start() -> None:
        nonlocal task
        await asyncio.gather(*(check(fleet, b) for b in fleet.backends))  # kinds known before serving
        task = asyncio.get_running_loop().create_task(run_checks(fleet), name="fleet-health")

    async def stop() -> None:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await fleet.close()

    @get("/metrics", summary="Prometheus metrics", include_in_schema=False)
    async def metrics_route() -> Response[bytes]:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    app = Litestar(
        route_handlers=[chat_completions, completions, models, backends, health, ready, metrics_route],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        request_max_body_size=max_body_bytes,
        on_startup=[start],
        on_shutdown=[stop],
        state=State({"fleet": fleet}),
        openapi_config=None,
        logging_config=None,
    )
    asgi: ASGIApp = app
    if api_key:
        from ..auth import RequireApiKey

        asgi = RequireApiKey(asgi, api_key)
    return Observe(asgi, metrics)
