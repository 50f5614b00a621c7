"""Connection hygiene on the gateway's OpenAI port, for real: the gateway on loopback, raw sockets
for what a hostile client does (a huge head, a drip, a silent connection, too many connections), and
the official `openai` client over TLS with a certificate from `ctxfuse certs server`. The same
protocol (shared/conn_limits.py) serves every listener; the last test holds each listener's config
to it."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import openai
import pytest

from cloud.serving.in_process import InProcessBackend
from edge.agent import Agent
from edge.config import EdgeConfig
from edge.server import agent_uvicorn_config
from gateway.config import GatewayConfig
from gateway.server import uvicorn_config
from shared import certs
from shared.conn_limits import ConnLimits, LimitedH11Protocol
from shared.tls import DeviceHttpProtocol, edge_listener

from .conftest import MODEL, Running, run_in_thread
from .raw_http import closed_by_server, connect, drip_until_closed, exchange, read_answer, request_head

LIMITS = ConnLimits(header_timeout_s=1.0, max_connections=3, max_connection_requests=2)


@pytest.fixture(scope="module")
def gateway(backend: InProcessBackend) -> Iterator[Running]:
    running = run_in_thread(backend, GatewayConfig(port=0, conn_limits=LIMITS))
    yield running
    running.stop()


def port_of(running: Running) -> int:
    port = running.server.bound_port
    assert port is not None
    return port


def test_a_64_kib_header_gets_431_in_the_openai_error_shape_and_a_close(gateway: Running) -> None:
    with connect(port_of(gateway)) as sock:
        answer = exchange(sock, request_head(extra=b"X-Pad: " + b"a" * 64 * 1024 + b"\r\n"))
        assert answer.status == 431
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error" and "too large" in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        assert closed_by_server(sock)


def test_a_head_within_the_size_bound_is_served(gateway: Running) -> None:
    with connect(port_of(gateway)) as sock:
        answer = exchange(sock, request_head(extra=b"X-Pad: " + b"a" * 16 * 1024 + b"\r\n"))
        assert answer.status == 200


def test_a_connection_dripping_its_head_is_closed_by_the_server(gateway: Running) -> None:
    head = request_head(extra=b"X-Pad: " + b"a" * 1000 + b"\r\n")  # 0.1 s a byte: 100 s if let through
    with connect(port_of(gateway)) as sock:
        assert drip_until_closed(sock, head)


def test_a_silent_connection_is_closed_by_the_server(gateway: Running) -> None:
    with connect(port_of(gateway)) as sock:
        assert closed_by_server(sock)


def test_a_kept_alive_connection_dripping_its_next_head_is_closed(gateway: Running) -> None:
    with connect(port_of(gateway)) as sock:
        assert exchange(sock, request_head()).status == 200
        assert drip_until_closed(sock, request_head(extra=b"X-Pad: " + b"a" * 1000 + b"\r\n"))


def test_a_connection_is_closed_after_its_last_allowed_request(gateway: Running) -> None:
    with connect(port_of(gateway)) as sock:
        first = exchange(sock, request_head())
        second = exchange(sock, request_head())
        assert (first.status, second.status) == (200, 200)
        assert first.headers.get("connection") != "close"
        assert second.headers.get("connection") == "close"  # max_connection_requests=2
        assert closed_by_server(sock)


def test_connections_past_the_cap_get_503_and_are_closed(backend: InProcessBackend) -> None:
    # its own gateway: the cap counts every open connection, so no other test may hold one
    limits = replace(LIMITS, header_timeout_s=30.0, max_connection_requests=100)
    running = run_in_thread(backend, GatewayConfig(port=0, conn_limits=limits))
    port = port_of(running)
    held = [connect(port) for _ in range(limits.max_connections)]
    try:
        for sock in held:  # each one served, then kept alive
            assert exchange(sock, request_head()).status == 200
        with connect(port) as extra:
            answer = read_answer(extra)  # refused as it is accepted, before it sends anything
            assert answer.status == 503
            assert answer.json()["error"]["type"] == "server_error"
            assert closed_by_server(extra)
        for sock in held:  # the refusal took nothing from the connections already open
            assert exchange(sock, request_head()).status == 200
    finally:
        for sock in held:
            sock.close()
        running.stop()


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tls")
    certs.init_ca(root)
    certs.issue_server(root, ["127.0.0.1", "localhost"])
    return root


def test_serve_over_tls_answers_an_openai_client_that_trusts_the_ca(
    backend: InProcessBackend, tls_dir: Path
) -> None:
    d = certs.TLSDir(tls_dir)
    config = GatewayConfig(port=0, ssl_certfile=d.server_cert, ssl_keyfile=d.server_key)
    running = run_in_thread(backend, config)
    base_url = f"https://127.0.0.1:{port_of(running)}/v1"
    trusted = ssl.create_default_context(cafile=str(d.ca_cert))
    try:
        with openai.DefaultHttpxClient(verify=trusted) as http:
            client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http)
            assert [m.id for m in client.models.list()] == [MODEL]
        # the system's CAs do not know ours: refused
        plain = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            plain.models.list()
    finally:
        running.stop()


def test_every_listener_runs_the_limited_protocol_with_its_limits(tls_dir: Path, tmp_path: Path) -> None:
    certs.issue_device(tls_dir, "alpha")
    gateway = uvicorn_config(object(), GatewayConfig(conn_limits=LIMITS))  # also the router's and workers'
    edge = edge_listener(object(), tls_dir, host="127.0.0.1", port=0, limits=LIMITS).config  # type: ignore[arg-type]
    agent = agent_uvicorn_config(_agent(tmp_path, tls_dir), "127.0.0.1", 0, limits=LIMITS)
    for config in (gateway, edge, agent):
        assert isinstance(config.http, type) and issubclass(config.http, LimitedH11Protocol)
        assert config.http.limits == LIMITS
    assert isinstance(edge.http, type) and issubclass(edge.http, DeviceHttpProtocol)


def _agent(tmp_path: Path, tls_dir: Path) -> Agent:
    config = EdgeConfig(gateway_url="https://127.0.0.1:1", tls_dir=tls_dir, name="alpha", state_dir=tmp_path)
    return Agent(config)
