"""The edge listener: a second uvicorn server in the gateway's process, on its own port, that takes
only clients with a device certificate from our CA that is not revoked (shared/tls.py), and serves
the edge routes, the model list and the Batch API (the agent's outbox forwards batches here). It
shares the gateway's state (engine, metrics, chunk store, batch runner) with the plain-HTTP app, and
starts and stops with it. The batch runner is one per process: the plain app makes and runs it; an
edge listener serving alone (tests) makes and runs its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn
from litestar import Litestar
from litestar.datastructures import State
from litestar.types import ASGIApp

from gateway.batch import routes as batch_routes
from gateway.batch.executor import engine_executor
from gateway.batch.runner import BatchRunner
from gateway.config import GatewayConfig
from gateway.edge import routes as edge_routes
from gateway.edge.device_limit import DeviceLimit
from gateway.errors import EXCEPTION_HANDLERS
from gateway.openai.routes import list_models, retrieve_model
from gateway.ops.observe import Observe
from gateway.server import bound_port
from gateway.state import Gateway
from shared.keep_alive import SERVER_KEEP_ALIVE_S
from shared.tls import edge_listener


def create_edge_app(gateway: Gateway) -> ASGIApp:
    owns_runner = gateway.batches is None
    batches = gateway.batches or BatchRunner(
        engine_executor(gateway),
        gateway.config.data / "batches.sqlite",
        max_running=gateway.config.max_running_batches,
    )
    gateway.batches = batches
    app = Litestar(
        route_handlers=[*edge_routes.ROUTES, list_models, retrieve_model, *batch_routes.ROUTES],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        request_max_body_size=gateway.config.max_body_bytes,
        on_startup=[batches.start] if owns_runner else [],
        on_shutdown=[batches.stop] if owns_runner else [],
        state=State({"gateway": gateway, "batches": batches}),
        openapi_config=None,
        logging_config=None,
    )
    limited = DeviceLimit(app, gateway.config.device_max_in_flight)
    return Observe(limited, gateway.metrics)


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
    # lifespan on: it runs the batch runner when this app owns it
    return edge_server_for(create_edge_app(gateway), gateway.config, lifespan="on")


def edge_server_for(app: ASGIApp, cfg: GatewayConfig, lifespan: str) -> EdgeServer:
    """The mutual-TLS listener on --edge-host/--edge-port for `app` (a gateway's or a router's)."""
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
        lifespan=lifespan,
        limits=cfg.conn_limits,
    )
    return EdgeServer(listener.config)
