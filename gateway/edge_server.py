"""The edge listener: a second uvicorn server in the gateway's process, on its own port, that takes
only clients with a device certificate from our CA that is not revoked (shared/tls.py), and serves
only the edge routes and the model list. It shares the gateway's state (engine, metrics, chunk
store) with the plain-HTTP app, and starts and stops with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import uvicorn
from litestar import Litestar
from litestar.datastructures import State
from litestar.types import ASGIApp

from shared.tls import edge_listener

from . import edge_routes
from .device_limit import DeviceLimit
from .errors import EXCEPTION_HANDLERS
from .observe import Observe
from .openai_routes import list_models, retrieve_model
from .state import Gateway


def create_edge_app(gateway: Gateway) -> ASGIApp:
    app = Litestar(
        route_handlers=[*edge_routes.ROUTES, list_models, retrieve_model],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        request_max_body_size=gateway.config.max_body_bytes,
        state=State({"gateway": gateway}),
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
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return None

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets)  # type: ignore[arg-type]
        if self.started and self.announce:
            host = self.config.host
            print(f"ctxfuse: edge listener (mutual TLS) at https://{host}:{self.bound_port}", flush=True)


def build_edge_server(gateway: Gateway) -> EdgeServer:
    cfg = gateway.config
    if cfg.tls_dir is None or cfg.edge_port is None:
        raise ValueError("the edge listener needs --edge-port and --tls-dir")
    listener = edge_listener(
        create_edge_app(gateway),  # type: ignore[arg-type]
        cfg.tls_dir,
        host=cfg.edge_host,
        port=cfg.edge_port,
        access_log=False,
        log_config=None,
        log_level=cfg.log_level,
        timeout_graceful_shutdown=int(cfg.shutdown_timeout_s),
        lifespan="off",
    )
    return EdgeServer(listener.config)
