"""Connection hygiene on the gateway's OpenAI port, for real: the gateway on loopback, raw sockets
for what a hostile client does (a huge head, a drip, a silent connection, too many connections), and
the official `openai` client over TLS with a certificate from `ctxfuse certs server`. Every
listener runs one of the two limited protocols of shared/conn_limits.py (httptools by default, h11
under the edge listener's device checks): each hostile client meets both; the last test holds each
listener's config to its protocol and limits."""

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
from shared import certs, conn_limits
from shared.conn_limits import ConnLimits, LimitedH11Protocol, LimitedHttpToolsProtocol
from shared.tls import DeviceHttpProtocol, edge_listener

from .conftest import MODEL, Running, run_in_thread
from .raw_http import closed_by_server, connect, drip_until_closed, exchange, read_answer, request_head

LIMITS = ConnLimits(header_timeout_s=1.0, max_connections=3, max_connection_requests=2)


PROTOCOLS = {"httptools": LimitedHttpToolsProtocol, "h11": LimitedH11Protocol}


def _serve(backend: InProcessBackend, limits: ConnLimits, protocol: str) -> Running:
    """A gateway whose listener runs `protocol` (the default one, or h11 put in its place)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(conn_limits, "LimitedHttpToolsProtocol", PROTOCOLS[protocol])
        running = run_in_thread(backend, GatewayConfig(port=0, conn_limits=limits))
    port = running.server.bound_port
    assert port is not None
    assert isinstance(running.server.config.http, type)
    assert issubclass(running.server.config.http, PROTOCOLS[protocol])
    return running


@pytest.fixture(scope="module", params=list(PROTOCOLS))
def gateway(backend: InProcessBackend, request: pytest.FixtureRequest) -> Iterator[Running]:
    running = _serve(backend, LIMITS, request.param)
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


def test_an_unfinished_head_past_the_bound_gets_431_before_its_timeout(gateway: Running) -> None:
    """A header line that never ends: refused once it outgrows the bound, not held until the head
    timer (LIMITS: 1 s; the guard on the read is 30 s, and the answer must be the 431)."""
    with connect(port_of(gateway)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 40 * 1024)
        answer = read_answer(sock)
        assert answer.status == 431 and answer.json()["error"]["type"] == "invalid_request_error"
        assert closed_by_server(sock)


def test_a_body_sent_with_its_head_is_not_counted_as_head(gateway: Running) -> None:
    """A small head and a 100 KiB body in one write reach the app (its own answer, not a 431)."""
    body = b'{"model": "' + b"m" * 100 * 1024 + b'"}'
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    with connect(port_of(gateway)) as sock:
        answer = exchange(sock, head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        error = answer.json()["error"]  # the app read the body: it misses `messages`
        assert answer.status == 400 and "messages" in error["message"] and error["param"] is not None


def test_pipelined_requests_are_answered_in_order(gateway: Running) -> None:
    """Two heads in one write: two answers, in order (the second, the connection's last under
    LIMITS, closes it, so the whole exchange is read to its end)."""
    with connect(port_of(gateway)) as sock:
        sock.sendall(request_head("/health") + request_head("/v1/models"))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    first, _, second = data.partition(b"HTTP/1.1 ")[2].partition(b"HTTP/1.1 ")
    assert first.startswith(b"200 ") and second.startswith(b"200 ")
    assert MODEL.encode() in second and MODEL.encode() not in first


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


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_connections_past_the_cap_get_503_and_are_closed(backend: InProcessBackend, protocol: str) -> None:
    # its own gateway: the cap counts every open connection, so no other test may hold one
    limits = replace(LIMITS, header_timeout_s=30.0, max_connection_requests=100)
    running = _serve(backend, limits, protocol)
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
        assert isinstance(config.http, type) and config.http.limits == LIMITS
    assert issubclass(gateway.http, LimitedHttpToolsProtocol)
    assert issubclass(agent.http, LimitedHttpToolsProtocol)
    assert issubclass(edge.http, DeviceHttpProtocol) and issubclass(edge.http, LimitedH11Protocol)


def _agent(tmp_path: Path, tls_dir: Path) -> Agent:
    config = EdgeConfig(gateway_url="https://127.0.0.1:1", tls_dir=tls_dir, name="alpha", state_dir=tmp_path)
    return Agent(config)
