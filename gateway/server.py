"""`ctxfuse serve`: load the engine, then serve the gateway with uvicorn until SIGINT or SIGTERM.

On the signal the gateway stops taking new requests (/ready turns 503, new API calls get a 503, the
listening socket closes), lets running requests finish for up to `shutdown_timeout_s`, then exits;
uvicorn cancels whatever still runs after that, and cancelled requests are aborted in the engine.

If the engine dies, the open requests fail with EngineDeadError (the backend sees to that) and `serve`
stops the same way and exits non-zero, so a supervisor (systemd, Kubernetes) restarts it: a process
whose engine is gone can only refuse work.
"""

from __future__ import annotations

import asyncio
from types import FrameType

import structlog
import uvicorn

from gateway.app import create_app
from gateway.backends.local import engine_gateway
from gateway.backends.worker import WorkerEngine
from gateway.config import GatewayConfig
from gateway.edge.stores import AnyChunkStore
from gateway.seam import Backend
from gateway.state import Gateway
from shared import conn_limits
from shared.draining import DrainingServer
from shared.heap import freeze_loaded
from shared.keep_alive import SERVER_KEEP_ALIVE_S

log = structlog.get_logger("ctxfuse.gateway")


def bound_port(server: uvicorn.Server) -> int | None:
    """The port a started server listens on (the one the OS chose for port 0)."""
    for listener in getattr(server, "servers", []):
        for sock in listener.sockets:
            return int(sock.getsockname()[1])
    return None


class GatewayServer(DrainingServer):
    """Also: mark the gateway draining on a signal, and report the bound address."""

    def __init__(
        self,
        config: uvicorn.Config,
        gateway: Gateway,
        on_started: bool = True,
        exit_on_engine_death: bool = False,
    ) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.announce = on_started
        # `serve` stops when the engine dies; an embedder (a test) may keep answering 503 instead
        self.exit_on_engine_death = exit_on_engine_death
        self.engine_died = False  # the stop was for a dead engine: `serve` exits non-zero
        # gc.freeze() once started: only in a process of its own (run_servers), never a test's
        self.freeze_heap = False

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop asks every 0.1 s whether to stop: a dead engine is a reason to
        if self.exit_on_engine_death and not self.engine_died and self.gateway.upstream.dead_reason():
            self.engine_died = True
            log.error("engine_dead_exiting")
            for companion in self.companions:
                companion.should_exit = True
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.gateway.draining:
            log.info("draining", signal=sig, timeout_s=self.config.timeout_graceful_shutdown)
        self.gateway.draining = True
        super().handle_exit(sig, frame)

    @property
    def bound_port(self) -> int | None:
        return bound_port(self)

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets)  # type: ignore[arg-type]
        if self.freeze_heap:  # the app, its upstream and its tables, started: not walked by the GC again
            freeze_loaded()
        if self.started and self.announce:
            cfg = self.gateway.config
            port = self.bound_port or cfg.port
            base = GatewayConfig(host=cfg.host, port=port, ssl_certfile=cfg.ssl_certfile).base_url
            name = self.gateway.upstream.model_name or "the fleet"
            print(f"ctxfuse: serving {name} at base_url={base}", flush=True)
            if self.gateway.keys is not None:  # a gateway or a router, not a worker: it has a console
                print(f"ctxfuse: console at {base.removesuffix('/v1')}/console", flush=True)


def uvicorn_config(app: object, config: GatewayConfig) -> uvicorn.Config:
    """The OpenAI port (of a gateway, a worker or a router): connection limits, and TLS when
    configured."""
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=config.host,
        port=config.port,
        access_log=False,  # the gateway writes its own request lines (ops/observe.py)
        log_config=None,
        log_level=config.log_level,
        timeout_graceful_shutdown=int(config.shutdown_timeout_s),
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        lifespan="on",
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
        **conn_limits.uvicorn_options(config.conn_limits),
    )


def build_server(
    backend: Backend,
    config: GatewayConfig,
    announce: bool = True,
    chunk_store: AnyChunkStore | None = None,
    worker: WorkerEngine | None = None,
    exit_on_engine_death: bool = False,
) -> GatewayServer:
    gateway = engine_gateway(backend, config, chunk_store, worker)
    return server_for(
        gateway, worker=worker is not None, announce=announce, exit_on_engine_death=exit_on_engine_death
    )


def server_for(
    gateway: Gateway, *, worker: bool = False, announce: bool = True, exit_on_engine_death: bool = False
) -> GatewayServer:
    """The OpenAI port's server over `gateway`, whatever its upstream."""
    app = create_app(gateway, worker=worker)
    return GatewayServer(uvicorn_config(app, gateway.config), gateway, announce, exit_on_engine_death)


def run_servers(server: GatewayServer) -> None:
    """Run the gateway, and its edge listener when configured, until a signal stops them. The
    process is the server's own (the CLI's): what it loaded at its start is frozen (shared/heap.py)."""
    server.freeze_heap = True
    if server.gateway.config.edge_port is None:
        server.run()
        return
    from gateway.edge.server import build_edge_server  # it imports this module

    edge = build_edge_server(server.gateway)
    server.companions.append(edge)
    serve_together(server, edge)


def serve_together(main: uvicorn.Server, companion: uvicorn.Server) -> None:
    """Both servers on one event loop until `main` stops (its handle_exit stops the companion)."""

    async def both() -> None:
        await asyncio.gather(main.serve(), companion.serve())

    with asyncio.Runner(loop_factory=main.config.get_loop_factory()) as runner:
        runner.run(both())
