"""The edge listener: a second uvicorn server in the gateway's process, on its own port, that takes
only clients with a device certificate from our CA that is not revoked (shared/tls.py), and serves
the edge routes, the model list and the Batch API (the agent's outbox forwards batches here), over
an engine or a fleet alike. It shares the gateway's state (upstream, metrics, chunk store, batch
runner) with the plain-HTTP app, and starts and stops with it. The batch runner is one per process:
the first app built makes it and its lifespan runs it (an edge listener serving alone, in tests,
runs its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn
from litestar.types import ASGIApp

from gateway.app import batch_runner, litestar_app
from gateway.batch import routes as batch_routes
from gateway.config import GatewayConfig
from gateway.edge import routes as edge_routes
from gateway.edge.device_limit import DeviceLimit
from gateway.openai.routes import list_models, retrieve_model
from gateway.ops import tracing
from gateway.ops.observe import Observe
from gateway.server import bound_port
from gateway.state import Gateway
from shared.keep_alive import SERVER_KEEP_ALIVE_S
from shared.tls import edge_listener


def create_edge_app(gateway: Gateway) -> ASGIApp:
    """The edge routes, the model list and the Batch API over the gateway's state, whatever its
    upstream; devices are authenticated by their certificate (shared/tls.py), not by a key."""
    batches = batch_runner(gateway)
    routes = [*edge_routes.ROUTES, list_models, retrieve_model, *batch_routes.ROUTES]
    app = litestar_app(gateway, routes, batches, openapi=False)
    limited = DeviceLimit(app, gateway.config.device_max_in_flight)
    return Observe(tracing.middleware(limited, worker=False), gateway.metrics)


class EdgeServer(uvicorn.Server):
    """Signals belong to the main server, which stops this one (GatewayServer.companions)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    announce = True

    @property
    def bound_port(self) -> int | None:
        return bound_port(self)

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets)  # type: ignore[arg-type]
        if self.started and self.announce:
            host = self.config.host
            print(f"ctxfuse: edge listener (mutual TLS) at https://{host}:{self.bound_port}", flush=True)


def build_edge_server(gateway: Gateway) -> EdgeServer:
    # its lifespan starts the upstream and the batch runner when this app is the first one built
    return edge_server_for(create_edge_app(gateway), gateway.config)


def edge_server_for(app: ASGIApp, cfg: GatewayConfig) -> EdgeServer:
    """The mutual-TLS listener on --edge-host/--edge-port for `app`."""
    if cfg.tls_dir is None or cfg.edge_port is None:
        raise ValueError("the edge listener needs --edge-port and --tls-dir")
    listener = edge_listener(
        app,  # type: ignore[arg-type]
        cfg.tls_dir,
        host=cfg.edge_host,
        port=cfg.edge_port,
        access_log=False,
        log_config=None,
        log_level=cfg.log_level,
        timeout_graceful_shutdown=int(cfg.shutdown_timeout_s),
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        lifespan="on",
        limits=cfg.conn_limits,
    )
    return EdgeServer(listener.config)
