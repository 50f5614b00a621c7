"""The gateway as an ASGI app, one for every upstream (an engine or the fleet, gateway/upstream.py):
Litestar routes inside the API-key check, inside request observation.

Observe (request id, log line, http metrics) -> its span, when traces are on (ops/tracing.py) ->
Authenticate (who calls: a tenant's key, the server's --api-key or an open server; per-key limits)
-> Litestar (the OpenAI routes, the Files and Batch API, /health, /ready, /metrics, the operator's
console at /console, and the upstream's own routes)

The first app built over a `Gateway` owns its lifecycle: its lifespan starts the upstream (the
fleet's health checks) and then the batch runner (batch/runner.py), and stops them in reverse. The
edge listener's app (edge/server.py) shares the same state and runner.

In worker mode (`ctxfuse worker`) the app serves the OpenAI routes and the internal routes a routing
gateway reads (backends/worker.py), and no Batch API: the gateway in front runs batches.

The app does not own the engine: whoever made it stops it (server.serve), so several apps (tests)
can share one engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from litestar import Litestar
from litestar.datastructures import State
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.types import ASGIApp

from gateway.access.auth import Authenticate
from gateway.access.key_stores import key_store
from gateway.batch import routes as batch_routes
from gateway.batch.executor import upstream_executor
from gateway.batch.runner import BatchRunner
from gateway.config import GatewayConfig
from gateway.console import routes as console
from gateway.console.usage import SharedUsage
from gateway.errors import EXCEPTION_HANDLERS
from gateway.openai import responses
from gateway.openai import routes as openai_routes
from gateway.openai.response_store import close_store
from gateway.ops import routes as ops_routes
from gateway.ops import tracing
from gateway.ops.observe import Observe
from gateway.ops.openapi import document_bodies
from gateway.state import Gateway
from shared.errors import CtxfuseError

Hooks = list[Callable[[], Awaitable[None]]]


def batch_runner(gateway: Gateway) -> BatchRunner:
    """The process's one batch runner, made by the first app that serves the Batch API."""
    if gateway.batches is None:
        config = gateway.config
        gateway.batches = BatchRunner(
            upstream_executor(gateway),
            config.data / "batches.sqlite",
            max_running=config.max_running_batches,
            file_ttl_s=config.file_ttl_s,
            redis=gateway.redis,  # replicas share files, batches and keys; each batch is leased
            lease_s=config.batch_lease_s,
            min_free_bytes=int(config.min_free_mib * 2**20),
        )
    return gateway.batches


def lifespan(gateway: Gateway, batches: BatchRunner | None) -> tuple[Hooks, Hooks]:
    """(on_startup, on_shutdown) for the first app built over `gateway`; nothing for the others."""
    if gateway.lifecycle_owned:
        return [], []
    gateway.lifecycle_owned = True
    up = gateway.upstream
    last: Hooks = [] if gateway.redis is None else [gateway.redis.aclose]  # after all that uses it
    if batches is None:
        return [up.start], [up.stop, *last]
    # the runner starts after the upstream: resumed batches find the fleet's backends known
    return [up.start, batches.start], [batches.stop, up.stop, *last]


def litestar_app(
    gateway: Gateway, routes: list[HTTPRouteHandler], batches: BatchRunner | None, openapi: bool = True
) -> Litestar:
    on_startup, on_shutdown = lifespan(gateway, batches)
    schema = OpenAPIConfig(title="ctxfuse", version="0.1.0", path="/schema") if openapi else None
    return Litestar(
        route_handlers=routes,
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        request_max_body_size=gateway.config.max_body_bytes,
        on_startup=on_startup,
        on_shutdown=on_shutdown,
        state=State({"gateway": gateway, "batches": batches}),
        openapi_config=schema,
        logging_config=None,
    )


WORKER_NEEDS_KEY = (
    "a worker needs a credential: start it with --api-key (or --api-key-file, or $CTXFUSE_API_KEY) "
    "and give the router the same key (--backend-key); its /internal routes are never open"
)


def require_worker_key(config: GatewayConfig) -> None:
    """A worker refuses to start without its key: checked before the model loads (ctxfuse worker),
    and again when its app is built."""
    if not config.api_key:
        raise CtxfuseError(WORKER_NEEDS_KEY)


def create_app(gateway: Gateway, *, worker: bool = False) -> ASGIApp:
    """The OpenAI port's app; `worker`: as `ctxfuse worker` (its router's key only, the tenant its
    router names, no Batch API)."""
    config = gateway.config
    if worker:
        require_worker_key(config)
    routes: list[HTTPRouteHandler] = [*openai_routes.ROUTES, *ops_routes.ROUTES, *gateway.upstream.routes]
    batches = None if worker else batch_runner(gateway)
    if batches is not None:
        routes += batch_routes.ROUTES
    if not worker:  # stored per gateway, so not on a worker; the console is the gateway's operator's
        routes += responses.ROUTES + console.ROUTES
    app = litestar_app(gateway, routes, batches)
    if not worker:
        app.on_shutdown.append(close_store)
    if not worker and gateway.redis is not None and gateway.usage is None:
        gateway.usage = SharedUsage(gateway.redis, gateway.metrics)
        app.on_startup.append(gateway.usage.start)
        app.on_shutdown.insert(0, gateway.usage.stop)  # its last flush, before Redis is closed
    document_bodies(app)
    # tenants' keys (`ctxfuse keys`) on the gateway; a worker answers only its router's key, and
    # takes the tenant its router names (for the prefix-cache partition)
    keys = None if worker else key_store(gateway)
    if keys is not None:
        app.on_shutdown.append(keys.close)  # (its SQLite file is not held open past the app's life)
        if gateway.keys is None:
            gateway.keys = keys
    asgi = Authenticate(
        app, api_key=config.api_key, keys=keys, limiter=gateway.limiter, trust_tenant_header=worker
    )
    return Observe(tracing.middleware(asgi, worker=worker), gateway.metrics)
