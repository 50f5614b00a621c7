"""The gateway in fleet mode (`ctxfuse serve --backend URL ...` or `--fleet fleet.toml`): the same
OpenAI routes, validated the same way, answered by the backends the fleet routes to. The OpenAI
error shape, API keys, request logs and /metrics are the gateway's own.

`/tokenize`, `/detokenize` and `/v1/models/{id}` are answered by a backend (the least loaded, for
the first two). The Files and Batch API is the gateway's own (its SQLite store under --data-dir); its
requests are routed like live ones (batch.py). The edge listener (edge.py) routes what devices send.

`GET /fleet/v1/backends` shows what the router knows: each backend's kind, version, circuit, load,
prefix keys, and the canary's state.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import Any

import httpx
import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.response import Stream
from litestar.types import ASGIApp

from cloud.engine.block_pool import salt_key
from gateway.access.auth import Authenticate, principal_of
from gateway.access.keys import KeyStore
from gateway.access.limits import RateLimiter
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.health import check, run_checks
from gateway.backends.fleet.keys import RequestKeys
from gateway.backends.fleet.proxy import VERSION_HEADER, Outgoing, forward
from gateway.batch import routes as batch_routes
from gateway.batch.runner import BatchRunner
from gateway.encoding import encode
from gateway.errors import EXCEPTION_HANDLERS, ServiceUnavailableError
from gateway.openai.disconnect import cancel_on_disconnect
from gateway.ops.metrics import Metrics
from gateway.ops.observe import Observe
from shared.forwarded_path import forwarded_path
from shared.protocol import Health

AnyRequest = Request[Any, Any, Any]
JSON = "application/json"


def _fleet(request: AnyRequest) -> Fleet:
    fleet: Fleet = request.app.state.fleet
    return fleet


async def route_body(request: AnyRequest, path: str, raw: bytes) -> Response[bytes] | Stream:
    """A chat or completion body (from the client, or expanded from the edge link), routed."""
    fleet = _fleet(request)
    _, keys = await asyncio.to_thread(fleet.request_keys, path, raw)
    salt = fleet.config.cache_salt(principal_of(request.state).cache_salt)  # the workers' partition
    if salt is not None:
        keys = replace(keys, extra_key=salt_key(salt))
    out = Outgoing(path, raw, keys, request.headers.get(VERSION_HEADER), salt)
    # a client gone before the answer: closing the backend request aborts the work there too
    return await cancel_on_disconnect(request.receive, forward(fleet, out))


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion (OpenAI), routed")
async def chat_completions(request: AnyRequest) -> Response[bytes] | Stream:
    return await route_body(request, "/v1/chat/completions", await request.body())


@post("/v1/completions", status_code=200, summary="Create a completion (OpenAI, legacy), routed")
async def completions(request: AnyRequest) -> Response[bytes] | Stream:
    return await route_body(request, "/v1/completions", await request.body())


async def _first_answer(fleet: Fleet, path: str) -> httpx.Response | None:
    """The first reachable backend's 200 to GET `path`, else the first 4xx (every backend saying
    no), else None when none answers."""
    refusal: httpx.Response | None = None
    for b in fleet.backends:
        if b.reachable and b.kind is not None:
            with contextlib.suppress(httpx.HTTPError):
                resp = await fleet.client.get(f"{b.url}{path}", timeout=5)
                if resp.status_code == 200:
                    return resp
                if resp.status_code < 500 and refusal is None:
                    refusal = resp
    return refusal


@get("/v1/models", summary="List models (those the backends serve)")
async def models(request: AnyRequest) -> Response[bytes]:
    resp = await _first_answer(_fleet(request), "/v1/models")
    if resp is not None and resp.status_code == 200:
        return Response(resp.content, media_type=JSON)
    return Response(encode({"object": "list", "data": []}), media_type=JSON)


@get("/v1/models/{model_id:path}", summary="Retrieve a model (as the backends describe it)")
async def model(request: AnyRequest) -> Response[bytes]:
    # the path as the client sent it, checked: never the decoded id, whose `../` the HTTP client
    # would resolve into another route of the backend (an /internal one, asked by us)
    resp = await _first_answer(_fleet(request), forwarded_path(request.scope["raw_path"]))
    if resp is None:
        raise ServiceUnavailableError("no backend is reachable")
    return Response(resp.content, status_code=resp.status_code, media_type=JSON)


async def _by_load(request: AnyRequest, path: str) -> Response[bytes] | Stream:
    """A request with no prompt to match (tokenizing): the least loaded backend of the request's
    version answers it, with the same failover as a completion."""
    fleet = _fleet(request)
    out = Outgoing(path, await request.body(), RequestKeys([], ""), request.headers.get(VERSION_HEADER))
    return await forward(fleet, out)


@post("/tokenize", status_code=200, summary="Token ids of a prompt or of chat messages (by a backend)")
async def tokenize(request: AnyRequest) -> Response[bytes] | Stream:
    return await _by_load(request, "/tokenize")


@post("/detokenize", status_code=200, summary="Text of token ids (by a backend)")
async def detokenize(request: AnyRequest) -> Response[bytes] | Stream:
    return await _by_load(request, "/detokenize")


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


def create_fleet_app(
    fleet: Fleet,
    metrics: Metrics,
    api_key: str | None,
    max_body_bytes: int,
    batches: BatchRunner,
    keys: KeyStore | None = None,
) -> ASGIApp:
    """`batches`: the process's one batch runner, shared with the edge listener's app (edge.py).
    `keys`: tenants' API keys (`ctxfuse keys`), checked as on the gateway with an engine."""
    task: asyncio.Task[None] | None = None

    async def start() -> None:
        nonlocal task
        await asyncio.gather(*(check(fleet, b) for b in fleet.backends))  # kinds known before serving
        task = asyncio.get_running_loop().create_task(run_checks(fleet), name="fleet-health")
        await batches.start()  # after the checks: resumed batches find the backends known

    async def stop() -> None:
        await batches.stop()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await fleet.close()

    @get("/metrics", summary="Prometheus metrics", include_in_schema=False)
    async def metrics_route() -> Response[bytes]:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    app = Litestar(
        route_handlers=[
            *(chat_completions, completions, models, model, tokenize, detokenize),
            *(backends, health, ready, metrics_route),
            *batch_routes.ROUTES,
        ],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        request_max_body_size=max_body_bytes,
        on_startup=[start],
        on_shutdown=[stop],
        state=State({"fleet": fleet, "batches": batches}),
        openapi_config=None,
        logging_config=None,
    )
    asgi = Authenticate(app, api_key=api_key, keys=keys, limiter=RateLimiter())
    return Observe(asgi, metrics)
