"""The two servers under test, each in its own process with one uvicorn worker on a loopback port.

`python -m gateway.bench.serve gateway PORT` serves the full gateway (default GatewayConfig, its
request log included, written to a discarded stderr) over the instant engine;
`python -m gateway.bench.serve gateway-unlimited PORT` serves the same gateway on uvicorn's own
httptools protocol, without the connection limits (shared/conn_limits.py) every listener has: what
those limits cost, measured beside the real thing (`ctxfuse bench gateway --compare-unlimited`);
`python -m gateway.bench.serve baseline PORT RECORDED.json` serves the baseline app;
`python -m gateway.bench.serve upstream PORT MODEL PLAIN.json STREAMED.json` serves an instant
OpenAI-compatible server for a router to stand before (`ctxfuse bench gateway --fleet`);
`python -m gateway.bench.serve bare-relay PORT UPSTREAM_URL` serves the least relay this stack can
make (bare_relay.py), the floor the router is measured beside;
`python -m gateway.bench.serve instant-worker PORT` serves a ctxfuse worker over the instant engine
with the default model's tokenizer and template (the same bench, behind the engine seam);
`python -m gateway.bench.serve keyed PORT DATA_DIR [REDIS_URL]` serves the gateway whose tenants'
keys and limits live in DATA_DIR or in that Redis (for `ctxfuse bench shared-state`);
`python -m gateway.bench.serve edge PORT EDGE_PORT TLS_DIR STORE` serves the gateway and its
mutual-TLS edge listener over the instant engine (for `ctxfuse bench edge`).
Both use uvicorn's `auto` loop and HTTP parser: uvloop and httptools when installed, as `ctxfuse serve`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvicorn

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A server subprocess, ready once its port accepts connections; stopped with SIGTERM."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "gateway.bench.serve", args[0], str(self.port), *args[1:]]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout_s: float = 60.0, port: int | None = None) -> None:
        """Until `port` (default: the main one) accepts connections."""
        port = port or self.port
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"bench server exited with status {self.proc.returncode}")
            try:
                socket.create_connection((HOST, port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"bench server not listening on port {port} after {timeout_s:.0f} s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _serve_gateway(port: int, limited: bool = True) -> None:
    from gateway.bench.fake_engine import InstantBackend
    from gateway.config import GatewayConfig
    from gateway.ops.logs import configure_logging
    from gateway.server import build_server

    with tempfile.TemporaryDirectory(prefix="ctxfuse-bench-gateway-") as data:  # never the user's data dir
        config = GatewayConfig(port=port, data_dir=Path(data))
        configure_logging(config.log_level)
        server = build_server(InstantBackend(), config, announce=False)
        if not limited:  # uvicorn resolves the protocol when it starts: before that it can be swapped
            server.config.http = "httptools"
        server.run()


def _serve_keyed(port: int, data: Path, redis_url: str | None) -> None:
    """The gateway over the instant engine with its keys in `data` or, given a URL, with keys and
    limits in that Redis (`ctxfuse bench shared-state`)."""
    from gateway.bench.fake_engine import InstantBackend
    from gateway.config import GatewayConfig
    from gateway.server import build_server

    config = GatewayConfig(port=port, data_dir=data, redis_url=redis_url, log_level="warning")
    build_server(InstantBackend(), config, announce=False).run()


def _serve_edge_gateway(port: int, edge_port: int, tls: Path, store: Path) -> None:
    from gateway.bench.fake_engine import InstantBackend
    from gateway.config import GatewayConfig
    from gateway.edge.chunk_store import ChunkStore
    from gateway.server import build_server, run_servers

    config = GatewayConfig(
        port=port,
        edge_host=HOST,
        edge_port=edge_port,
        tls_dir=tls,
        log_level="warning",
        data_dir=store.parent,
    )
    chunks = ChunkStore(store, 256 * 2**20)
    try:
        run_servers(build_server(InstantBackend(), config, announce=False, chunk_store=chunks))
    finally:
        chunks.close()


def _serve_baseline(port: int, recorded: Path) -> None:
    from gateway.bench.baseline import BaselineApp, Recorded

    _serve_asgi(BaselineApp(Recorded.load(recorded)), port)


def _serve_asgi(app: object, port: int) -> None:
    """A raw ASGI app on uvicorn, nothing else in the process."""
    config = uvicorn.Config(app, host=HOST, port=port, access_log=False, log_config=None, lifespan="off")  # type: ignore[arg-type]
    uvicorn.Server(config).run()


def _serve_upstream(port: int, model: str, plain: Path, streamed: Path) -> None:
    from gateway.bench.baseline import Recorded
    from gateway.bench.instant_upstream import InstantUpstream

    _serve_asgi(InstantUpstream(model, Recorded.load(plain), Recorded.load(streamed)), port)


def _serve_bare_relay(port: int, upstream: str) -> None:
    from gateway.bench.bare_relay import BareRelay

    _serve_asgi(BareRelay(upstream), port)


WORKER_KEY = "bench-worker-key"  # the instant worker's key: its router sends it (--backend-key)
WORKER_CONTEXT = 32_768  # room for the 16,000-token prompts of `bench gateway --fleet`


def _serve_instant_worker(port: int) -> None:
    """A `ctxfuse worker` whose engine answers at once (the instant engine) but whose text side is
    the default model's tokenizer and chat template: a router before it templates, tokenizes and keys
    prompts as before a real worker, and only the generation is free."""
    from cloud.engine.kv.block_events import BlockEventLog
    from cloud.model.text_side import describe_text_side, load_text_side
    from gateway.backends.worker import WorkerEngine
    from gateway.bench.fake_engine import MODEL_NAME, InstantBackend
    from gateway.config import GatewayConfig
    from gateway.server import build_server, run_servers

    tokenizer, template = load_text_side(None)
    backend = InstantBackend()
    backend.tokenizer, backend.max_model_len = tokenizer, WORKER_CONTEXT
    side = describe_text_side(MODEL_NAME, tokenizer, template, max_model_len=WORKER_CONTEXT)
    worker = WorkerEngine(block_size=16, max_num_seqs=256, events=BlockEventLog(), text_side=side)
    with tempfile.TemporaryDirectory(prefix="ctxfuse-bench-worker-") as data:
        config = GatewayConfig(port=port, data_dir=Path(data), api_key=WORKER_KEY, log_level="warning")
        run_servers(build_server(backend, config, announce=False, worker=worker))  # as `ctxfuse worker`


def main(argv: list[str]) -> int:
    kind, port = argv[0], int(argv[1])
    if kind == "gateway":
        _serve_gateway(port)
    elif kind == "gateway-unlimited":
        _serve_gateway(port, limited=False)
    elif kind == "keyed":
        _serve_keyed(port, Path(argv[2]), argv[3] if len(argv) > 3 else None)
    elif kind == "instant-worker":
        _serve_instant_worker(port)
    elif kind == "upstream":
        _serve_upstream(port, argv[2], Path(argv[3]), Path(argv[4]))
    elif kind == "bare-relay":
        _serve_bare_relay(port, argv[2])
    elif kind == "edge":
        _serve_edge_gateway(port, int(argv[2]), Path(argv[3]), Path(argv[4]))
    else:
        _serve_baseline(port, Path(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
