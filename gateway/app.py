"""The gateway as an ASGI app: Litestar routes inside the API-key check, inside request observation.

Observe (request id, log line, http metrics) -> Authenticate (who calls: a tenant's key, the
server's --api-key or an open server; per-key limits) -> Litestar

The app's lifespan starts and stops the batch runner (batch/runner.py), which runs the Batch API's work.

In worker mode (`ctxfuse worker`) the app serves the OpenAI routes and the internal routes a routing
gateway reads (backends/worker.py), and no Batch API: the gateway in front runs batches.

The app does not own the backend: whoever made it stops it (server.serve), so several apps (tests)
can share one engine.
"""

from __future__ import annotations

from litestar import Litestar
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.types import ASGIApp

from gateway.access.auth import Authenticate
from gateway.access.keys import KeyStore
from gateway.backends import worker as worker_routes
from gateway.backends.engine import Backend
from gateway.backends.worker import WorkerEngine
from gateway.batch import routes as batch_routes
from gateway.batch.executor import engine_executor
from gateway.batch.runner import BatchRunner
from gateway.config import GatewayConfig
from gateway.errors import EXCEPTION_HANDLERS
from gateway.openai import routes as openai_routes
from gateway.ops import routes as ops_routes
from gateway.ops.observe import Observe
from gateway.ops.openapi import document_bodies
from gateway.state import Gateway
from shared.errors import CtxfuseError


def create_app(
    backend: Backend,
    config: GatewayConfig,
    gateway: Gateway | None = None,
    worker: WorkerEngine | None = None,
) -> tuple[ASGIApp, Gateway]:
    """The plain-HTTP OpenAI app; `gateway` shares state with an edge listener's app (edge/server.py).
    With `worker` (the engine behind `backend`), the app of `ctxfuse worker`."""
    if worker is not None and not config.api_key:
        raise CtxfuseError(
            "a worker needs a credential: start it with --api-key (or --api-key-file, or "
            "$CTXFUSE_API_KEY) and give the router the same key (--backend-key); its /internal routes "
            "are never open"
        )
    gateway = gateway or Gateway(backend, config)
    if worker is None:
        batches = gateway.batches or BatchRunner(
            engine_executor(gateway),
            config.data / "batches.sqlite",
            max_running=config.max_running_batches,
            file_ttl_s=config.file_ttl_s,
        )
        gateway.batches = batches  # one per process, shared with the edge listener's app
        routes = [*openai_routes.ROUTES, *ops_routes.ROUTES, *batch_routes.ROUTES]
        state = State({"gateway": gateway, "batches": batches})
        on_startup, on_shutdown = [batches.start], [batches.stop, gateway.images.close]
    else:
        routes = [*openai_routes.ROUTES, *ops_routes.ROUTES, *worker_routes.ROUTES]
        state = State({"gateway": gateway, "worker": worker})
        on_startup, on_shutdown = [], [gateway.images.close]
    app = Litestar(
        route_handlers=routes,
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        request_max_body_size=config.max_body_bytes,
        on_startup=on_startup,
        on_shutdown=on_shutdown,
        state=state,
        openapi_config=OpenAPIConfig(title="ctxfuse", version="0.1.0", path="/schema"),
        logging_config=None,
    )
    document_bodies(app)
    # tenants' keys (`ctxfuse keys`) on the gateway; a worker answers only its router's key, and
    # takes the tenant its router names (for the prefix-cache partition)
    keys = KeyStore(config.data / "keys.sqlite") if worker is None else None
    trust = worker is not None
    asgi = Authenticate(
        app, api_key=config.api_key, keys=keys, limiter=gateway.limiter, trust_tenant_header=trust
    )
    return Observe(asgi, gateway.metrics), gateway
