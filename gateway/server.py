"""`ctxfuse serve`: load the engine, then serve the gateway with uvicorn until SIGINT or SIGTERM.

On the signal the gateway stops taking new requests (/ready turns 503, new API calls get a 503, the
listening socket closes), lets running requests finish for up to `shutdown_timeout_s`, then exits;
uvicorn cancels whatever still runs after that, and cancelled requests are aborted in the engine.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

import structlog
import uvicorn

from cloud.engine.config import EngineConfig

from .app import create_app
from .backend import Backend, InProcessBackend
from .config import GatewayConfig
from .logs import configure_logging
from .state import Gateway

log = structlog.get_logger("ctxfuse.gateway")


class GatewayServer(uvicorn.Server):
    """uvicorn, plus: mark the gateway draining on a signal, and report the bound address."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, on_started: bool = True) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.announce = on_started

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal after its graceful shutdown, so the process dies of SIGTERM;
        # a completed drain is a clean exit here (status 0), and serve() gets to stop the engine.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.gateway.draining:
            log.info("draining", signal=sig, timeout_s=self.config.timeout_graceful_shutdown)
        self.gateway.draining = True
        super().handle_exit(sig, frame)

    @property
    def bound_port(self) -> int | None:
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return None

    async def startup(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
        await super().startup(sockets)  # type: ignore[arg-type]
        if self.started and self.announce:
            cfg = self.gateway.config
            port = self.bound_port or cfg.port
            base = GatewayConfig(host=cfg.host, port=port).base_url
            print(f"ctxfuse: serving {self.gateway.backend.model_name} at base_url={base}", flush=True)


def uvicorn_config(app: object, config: GatewayConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=config.host,
        port=config.port,
        access_log=False,  # the gateway writes its own request lines (observe.py)
        log_config=None,
        log_level=config.log_level,
        timeout_graceful_shutdown=int(config.shutdown_timeout_s),
        lifespan="on",
    )


def build_server(backend: Backend, config: GatewayConfig, announce: bool = True) -> GatewayServer:
    app, gateway = create_app(backend, config)
    return GatewayServer(uvicorn_config(app, config), gateway, announce)


def serve(engine_config: EngineConfig, config: GatewayConfig) -> int:
    configure_logging(config.log_level)
    if not config.is_loopback and not config.api_key:
        print(
            f"ctxfuse: warning: serving on {config.host} without an API key; anyone who can reach this "
            "address can use the model (set --api-key or CTXFUSE_API_KEY)",
            file=sys.stderr,
        )
    print("ctxfuse: loading the model ...", file=sys.stderr, flush=True)
    backend = InProcessBackend.from_config(engine_config)
    print(f"ctxfuse: {backend.engine.core.kv_plan.describe()}", file=sys.stderr, flush=True)
    server = build_server(backend, config)
    try:
        server.run()
    finally:
        backend.shutdown()
    return 0 if server.started else 1
