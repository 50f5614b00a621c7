"""A real agent on loopback in front of a real gateway edge listener (a fleet gateway, mutual TLS with
real certificates, over a stub OpenAI server): what the local-port tests need, without a model.
`gateway_requests()` counts every request the gateway answered, on either of its ports."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import uvicorn

from edge.agent import Agent
from edge.config import EdgeConfig
from edge.server import agent_uvicorn_config
from gateway.backends.fleet.serve import build_fleet_server
from gateway.config import GatewayConfig
from gateway.edge.server import build_edge_server
from gateway.ops.metrics import Metrics
from gateway.server import serve_together
from shared.certs import init_ca, issue_device, issue_server

from ..gateway.fleet.openai_stub import StubServer
from ..gateway.fleet.stub_fleet import fleet_of


def _started(*servers: uvicorn.Server) -> None:
    deadline = time.monotonic() + 30
    while not all(s.started for s in servers):
        if time.monotonic() > deadline:
            raise RuntimeError("a server did not start")
        time.sleep(0.02)


def _port(server: uvicorn.Server) -> int:
    return int(server.servers[0].sockets[0].getsockname()[1])


@dataclass
class Gatewayside:
    tls: Path
    edge_url: str  # the edge listener the agents talk to
    stub: StubServer  # the one backend: `behaviour.seen` holds every chat body that reached it
    metrics: Metrics

    def gateway_requests(self) -> float:
        text = self.metrics.render().decode()
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("ctxfuse_http_requests_total{")
        )

    def agent_config(self, state: Path, **options: object) -> EdgeConfig:
        config = EdgeConfig(gateway_url=self.edge_url, tls_dir=self.tls, name="dev1", port=0, state_dir=state)
        return replace(config, **options)  # type: ignore[arg-type]


@contextmanager
def gatewayside(tmp: Path) -> Iterator[Gatewayside]:
    tls = tmp / "tls"
    init_ca(tls)
    issue_server(tls, ["127.0.0.1"])
    issue_device(tls, "dev1")
    stub = StubServer("a")
    config = GatewayConfig(port=0, edge_host="127.0.0.1", edge_port=0, tls_dir=tls, data_dir=tmp / "gw")
    config = replace(config, chunk_store=tmp / "chunks.sqlite", chunk_store_mib=64)
    server, _ = build_fleet_server(fleet_of(stub), config, rng=random.Random(0))
    store = server.gateway.chunk_store
    assert store is not None
    edge = build_edge_server(server.gateway)
    server.companions.append(edge)
    thread = threading.Thread(target=serve_together, args=(server, edge), daemon=True, name="fleet+edge")
    thread.start()
    try:
        _started(server, edge)
        yield Gatewayside(tls, f"https://127.0.0.1:{_port(edge)}", stub, server.gateway.metrics)
    finally:
        server.should_exit = edge.should_exit = True
        thread.join(timeout=15)
        store.close()
        stub.stop()


@contextmanager
def running_agent(config: EdgeConfig) -> Iterator[str]:
    """The agent served on 127.0.0.1; yields its base URL (without /v1)."""
    with serving(Agent(config)) as url:
        yield url


@contextmanager
def serving(agent: Agent) -> Iterator[str]:
    """`agent` served on 127.0.0.1 (for a test that also reaches into it); yields its base URL."""
    server = uvicorn.Server(agent_uvicorn_config(agent, "127.0.0.1", 0))
    thread = threading.Thread(target=server.run, daemon=True, name="agent")
    thread.start()
    try:
        _started(server)
        yield f"http://127.0.0.1:{_port(server)}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
