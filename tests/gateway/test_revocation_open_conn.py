"""A device revoked while its connection is open: the gateway with its edge listener on loopback (as
`ctxfuse serve --edge-port --tls-dir` runs them), one TLS connection held by hand across the
revocation, and the next request on that same connection refused; and the edge listener closing an
idle connection of a revoked device on its own."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from cloud.serving.in_process import InProcessBackend
from gateway.config import GatewayConfig
from gateway.edge.server import EdgeServer, build_edge_server
from gateway.server import GatewayServer, build_server, serve_together
from shared import certs
from shared.conn_limits import ConnLimits
from shared.tls import client_context, edge_listener

from .raw_http import GUARD_S, closed_by_server, exchange, request_head


@dataclass
class EdgeGateway:
    server: GatewayServer
    edge: EdgeServer
    tls_dir: Path

    @property
    def edge_port(self) -> int:
        port = self.edge.bound_port
        assert port is not None
        return port


@pytest.fixture(scope="module")
def gateway(backend: InProcessBackend, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EdgeGateway]:
    tls = tmp_path_factory.mktemp("tls")
    certs.init_ca(tls)
    certs.issue_server(tls, ["127.0.0.1", "localhost"])
    for name in ("alpha", "beta"):
        certs.issue_device(tls, name)
    config = GatewayConfig(
        port=0, edge_host="127.0.0.1", edge_port=0, tls_dir=tls, data_dir=tmp_path_factory.mktemp("data")
    )
    server = build_server(backend, config, announce=False)
    edge = build_edge_server(server.gateway)
    edge.announce = False
    thread = threading.Thread(
        target=serve_together, args=(server, edge), name="test-edge-gateway", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + GUARD_S
    while not (server.started and edge.started):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test gateway did not start")
        time.sleep(0.02)
    yield EdgeGateway(server, edge, tls)
    server.should_exit = edge.should_exit = True
    thread.join(timeout=GUARD_S)


def device_connection(gateway: EdgeGateway, name: str) -> ssl.SSLSocket:
    return _connect(gateway.edge_port, gateway.tls_dir, name)


def test_a_device_revoked_mid_connection_is_refused_on_its_next_request(gateway: EdgeGateway) -> None:
    models = request_head("/v1/models")
    with device_connection(gateway, "alpha") as alpha, device_connection(gateway, "beta") as beta:
        assert exchange(alpha, models).status == 200
        assert exchange(beta, models).status == 200

        certs.revoke_device(gateway.tls_dir, "alpha")

        refused = exchange(alpha, models)  # the same connection, its handshake long done
        assert refused.status == 403
        error = refused.json()["error"]
        assert error["type"] == "permission_error" and "revoked" in error["message"]
        assert refused.headers.get("connection") == "close"
        assert closed_by_server(alpha)
        # another device's open connection is untouched
        assert exchange(beta, models).status == 200
    # and alpha cannot come back on a new connection
    with pytest.raises((ssl.SSLError, ConnectionResetError)), device_connection(gateway, "alpha") as again:
        exchange(again, models)


async def hello(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_an_idle_connection_of_a_revoked_device_is_closed_without_a_request(tmp_path: Path) -> None:
    certs.init_ca(tmp_path)
    certs.issue_server(tmp_path, ["127.0.0.1"])
    for name in ("alpha", "beta"):
        certs.issue_device(tmp_path, name)
    # nothing else may close the idle connection inside the hang guard: no head timeout, no idling out
    limits = ConnLimits(header_timeout_s=10 * GUARD_S)
    listener = edge_listener(
        hello,
        tmp_path,
        host="127.0.0.1",
        port=0,
        limits=limits,
        revocation_check_s=0.2,
        timeout_keep_alive=int(10 * GUARD_S),
        log_config=None,
        lifespan="off",
    )
    server = uvicorn.Server(listener.config)
    thread = threading.Thread(target=server.run, name="test-edge-listener", daemon=True)
    thread.start()
    deadline = time.monotonic() + GUARD_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test edge listener did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        with _connect(port, tmp_path, "alpha") as alpha, _connect(port, tmp_path, "beta") as beta:
            assert exchange(alpha, request_head()).status == 200
            assert exchange(beta, request_head()).status == 200
            certs.revoke_device(tmp_path, "alpha")
            assert closed_by_server(alpha)  # idle, sending nothing: closed by the server's own check
            assert exchange(beta, request_head()).status == 200
    finally:
        server.should_exit = True
        thread.join(timeout=GUARD_S)


def _connect(port: int, tls_dir: Path, name: str) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=GUARD_S)
    return client_context(tls_dir, name).wrap_socket(raw, server_hostname="127.0.0.1")
