"""The edge listener of a routing gateway (`ctxfuse serve --fleet ... --edge-port P --tls-dir D`):
devices with a certificate from our CA reach the fleet as they reach a single gateway.

The router keeps the edge link's chunk store (the agent's long strings, deduplicated), puts each
request's strings back byte for byte (gateway/edge/link.py), and routes the result like any chat or
completion: the worker that holds the prompt's prefix gets it. Images arrive as features the device
made; the router forwards them, and the worker renders them. The model list and the Batch API (the
agent's outbox forwards batches here) are served too, on the same runner as the plain port's.
"""

from __future__ import annotations

from typing import Any

from litestar import Litestar, Request, Response, post
from litestar.datastructures import State
from litestar.response import Stream
from litestar.types import ASGIApp

from gateway.backends.fleet.app import model, models, route_body
from gateway.backends.fleet.fleet import Fleet
from gateway.batch import routes as batch_routes
from gateway.batch.runner import BatchRunner
from gateway.config import GatewayConfig
from gateway.edge.chunk_store import ChunkStore
from gateway.edge.device_limit import DeviceLimit
from gateway.edge.routes import receive_edge_request
from gateway.edge.server import EdgeServer, edge_server_for
from gateway.errors import EXCEPTION_HANDLERS
from gateway.ops.metrics import Metrics
from gateway.ops.observe import Observe

AnyRequest = Request[Any, Any, Any]
_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}


@post("/edge/v1/request", status_code=200, summary="An OpenAI request over the edge link (msgpack), routed")
async def edge_request(request: AnyRequest) -> Response[bytes] | Stream:
    state = request.app.state
    endpoint, body = await receive_edge_request(request, state.chunk_store, state.metrics)
    return await route_body(request, _PATHS[endpoint], body)


def create_fleet_edge_app(
    fleet: Fleet, store: ChunkStore, batches: BatchRunner, metrics: Metrics, config: GatewayConfig
) -> ASGIApp:
    """The runner is the plain app's (it starts and stops it); this app only serves its routes."""
    app = Litestar(
        route_handlers=[edge_request, models, model, *batch_routes.ROUTES],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        request_max_body_size=config.max_body_bytes,
        state=State({"fleet": fleet, "batches": batches, "chunk_store": store, "metrics": metrics}),
        openapi_config=None,
        logging_config=None,
    )
    return Observe(DeviceLimit(app, config.device_max_in_flight), metrics)


def build_fleet_edge_server(
    fleet: Fleet, store: ChunkStore, batches: BatchRunner, metrics: Metrics, config: GatewayConfig
) -> EdgeServer:
    app = create_fleet_edge_app(fleet, store, batches, metrics, config)
    # lifespan off: the plain app's lifespan runs the health checks and the batch runner
    return edge_server_for(app, config, lifespan="off")
