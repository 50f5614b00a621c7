"""Mutual TLS on the edge listener, for real: uvicorn on a loopback port in a thread, httpx clients
with `client_context`. Who gets in, who is refused at the handshake (and the log line saying why),
revocation while running, and the device name reaching the ASGI app."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
import uvicorn

from shared import certs
from shared.tls import (
    DeviceHttpProtocol,
    DeviceScope,
    RevocationWatcher,
    client_context,
    edge_listener,
    server_context,
)

UVICORN = {"log_config": None, "lifespan": "off", "access_log": False}


async def whoami(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
    body = json.dumps({"device": scope["state"].get("device")}).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True)
class Pki:
    root: Path  # the gateway's CA: server cert for 127.0.0.1/localhost, devices alpha, beta, gamma (revoked)
    other: Path  # an unrelated CA, with a device also named alpha and its own server certificate


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root, other = tmp_path_factory.mktemp("tls"), tmp_path_factory.mktemp("other")
    for d in (root, other):
        certs.init_ca(d)
        certs.issue_server(d, ["127.0.0.1", "localhost"])
        certs.issue_device(d, "alpha")
    certs.issue_device(root, "beta")
    certs.issue_device(root, "gamma")
    certs.revoke_device(root, "gamma")
    return Pki(root, other)


@contextlib.contextmanager
def serving(config: uvicorn.Config) -> Iterator[str]:
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-edge-listener", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test edge listener did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"https://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def url(pki: Pki) -> Iterator[str]:
    listener = edge_listener(whoami, pki.root, host="127.0.0.1", port=0, **UVICORN)
    with serving(listener.config) as u:
        yield u


def manual_listener(pki: Pki) -> tuple[uvicorn.Config, RevocationWatcher]:
    """The pieces by hand, with uvicorn's defaults (proxy headers on) and no per-handshake refresh:
    the CRL changes only on refresh()."""
    context = server_context(pki.root)
    config = uvicorn.Config(
        DeviceScope(whoami),
        host="127.0.0.1",
        port=0,
        http=DeviceHttpProtocol,
        ssl_context_factory=lambda _c, _d: context,
        **UVICORN,  # type: ignore[arg-type]
    )
    return config, RevocationWatcher(context, pki.root)


def get_device(url: str, context: ssl.SSLContext, **kwargs: Any) -> str:
    # a new client each time: a new connection, so a new handshake
    with httpx.Client(verify=context, timeout=5) as client:
        resp = client.get(url, **kwargs)
    assert resp.status_code == 200
    device: str = resp.json()["device"]
    return device


def foreign_client(pki: Pki, cert_dir: Path | None, name: str = "alpha") -> ssl.SSLContext:
    """Trusts the gateway's CA; presents the certificate from `cert_dir` (None: no certificate)."""
    ctx = ssl.create_default_context(cafile=str(certs.TLSDir(pki.root).ca_cert))
    if cert_dir is not None:
        d = certs.TLSDir(cert_dir)
        ctx.load_cert_chain(d.device_cert(name), d.device_key(name))
    return ctx


def refused_with(logs: list[MutableMapping[str, Any]], reason: str) -> MutableMapping[str, Any]:
    # the log line is written on the server's thread as the alert goes out; give it a moment
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        for entry in list(logs):
            if entry["event"] == "edge_tls_refused" and entry["reason"] == reason:
                return entry
        time.sleep(0.01)
    raise AssertionError(f"no edge_tls_refused with reason {reason!r} in {logs}")


def test_a_valid_device_gets_200_and_its_name_reaches_the_app(pki: Pki, url: str) -> None:
    assert get_device(url, client_context(pki.root, "alpha")) == "alpha"
    assert get_device(url, client_context(pki.root, "beta")) == "beta"


def test_each_kept_alive_connection_keeps_its_own_device(pki: Pki, url: str) -> None:
    with (
        httpx.Client(verify=client_context(pki.root, "alpha"), timeout=5) as a,
        httpx.Client(verify=client_context(pki.root, "beta"), timeout=5) as b,
    ):
        names = [c.get(url).json()["device"] for _ in range(3) for c in (a, b)]
    assert names == ["alpha", "beta"] * 3


def test_x_forwarded_for_cannot_borrow_another_connections_device(pki: Pki) -> None:
    # uvicorn trusts X-Forwarded-For from loopback by default and rewrites scope["client"] with it;
    # the device name is bound to the connection, so pointing it at beta's address changes nothing
    config, _ = manual_listener(pki)
    with serving(config) as u:
        port = int(u.rsplit(":", 1)[1])
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            client_context(pki.root, "beta").wrap_socket(raw, server_hostname="127.0.0.1") as beta,
        ):
            beta.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b'"beta"' in _read_response(beta)
            forged = {"x-forwarded-for": f"127.0.0.1:{beta.getsockname()[1]}"}
            assert get_device(u, client_context(pki.root, "alpha"), headers=forged) == "alpha"


def _read_response(tls: ssl.SSLSocket) -> bytes:
    data = b""
    while b'"}' not in data:
        chunk = tls.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_no_client_certificate_is_refused_and_logged(pki: Pki, url: str) -> None:
    with structlog.testing.capture_logs() as logs, pytest.raises(httpx.TransportError):
        get_device(url, foreign_client(pki, None))
    entry = refused_with(logs, "no certificate")
    assert entry["alert"] == "certificate_required" and entry["device"] is None
    assert entry["log_level"] == "warning"


def test_a_certificate_from_another_ca_is_refused_and_logged(pki: Pki, url: str) -> None:
    with structlog.testing.capture_logs() as logs, pytest.raises(httpx.TransportError):
        get_device(url, foreign_client(pki, pki.other, "alpha"))
    entry = refused_with(logs, "unknown CA")
    assert entry["device"] == "alpha"  # the name it claimed, from the certificate it offered


def test_a_device_revoked_before_start_is_refused_and_logged(pki: Pki, url: str) -> None:
    with structlog.testing.capture_logs() as logs, pytest.raises(httpx.TransportError):
        get_device(url, client_context(pki.root, "gamma"))
    entry = refused_with(logs, "certificate revoked")
    assert entry["device"] == "gamma"
    assert entry["serial"] == {r.name: r.serial for r in certs.list_devices(pki.root)}["gamma"]


def test_a_server_certificate_is_not_accepted_as_a_device(pki: Pki, url: str) -> None:
    ctx = foreign_client(pki, None)
    d = certs.TLSDir(pki.root)
    ctx.load_cert_chain(d.server_cert, d.server_key)
    with structlog.testing.capture_logs() as logs, pytest.raises(httpx.TransportError):
        get_device(url, ctx)
    refused_with(logs, "certificate not for client use")


def test_tls_1_2_is_refused_so_no_session_cache_can_skip_the_crl(pki: Pki, url: str) -> None:
    ctx = client_context(pki.root, "alpha")
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with structlog.testing.capture_logs() as logs, pytest.raises(httpx.TransportError):
        get_device(url, ctx)
    refused_with(logs, "TLS version below 1.3")


def test_sessions_are_never_resumed(pki: Pki, url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    ctx = client_context(pki.root, "alpha")
    session = None
    for _ in range(2):
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname="127.0.0.1", session=session) as tls,
        ):
            tls.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert b'"alpha"' in _read_response(tls)
            assert not tls.session_reused
            session = tls.session


def test_a_client_refuses_a_gateway_whose_certificate_is_from_another_ca(pki: Pki) -> None:
    foreign = edge_listener(whoami, pki.other, host="127.0.0.1", port=0, **UVICORN)
    with structlog.testing.capture_logs() as logs, serving(foreign.config) as other_url:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            get_device(other_url, client_context(pki.root, "alpha"))
        deadline = time.monotonic() + 2
        while not any(e["event"] == "edge_tls_aborted_by_client" for e in logs):
            assert time.monotonic() < deadline, logs
            time.sleep(0.01)


def test_revocation_applies_to_new_handshakes_after_refresh(pki: Pki) -> None:
    certs.issue_device(pki.root, "delta")
    config, watcher = manual_listener(pki)
    assert watcher.refresh()  # the first call loads the file once, whatever server_context read
    with serving(config) as u:
        delta = client_context(pki.root, "delta")
        with httpx.Client(verify=delta, timeout=5) as held:
            assert held.get(u).json()["device"] == "delta"
            certs.revoke_device(pki.root, "delta")
            # not refreshed yet: the live context still has the old CRL
            assert get_device(u, delta) == "delta"
            assert watcher.refresh()
            assert not watcher.refresh()  # unchanged file: a stat, nothing loaded
            with structlog.testing.capture_logs() as logs, pytest.raises(httpx.TransportError):
                get_device(u, delta)
            assert refused_with(logs, "certificate revoked")["device"] == "delta"
            # a connection made before the revocation is not cut; only new handshakes are checked
            assert held.get(u).json()["device"] == "delta"
        assert get_device(u, client_context(pki.root, "alpha")) == "alpha"


def test_edge_listener_reloads_the_crl_on_every_handshake(pki: Pki, url: str) -> None:
    certs.issue_device(pki.root, "epsilon")
    epsilon = client_context(pki.root, "epsilon")
    assert get_device(url, epsilon) == "epsilon"
    certs.revoke_device(pki.root, "epsilon")
    with structlog.testing.capture_logs() as logs, pytest.raises(httpx.TransportError):
        get_device(url, epsilon)
    refused_with(logs, "certificate revoked")
    assert get_device(url, client_context(pki.root, "alpha")) == "alpha"


def test_a_request_without_a_device_is_refused_not_served() -> None:
    sent: list[MutableMapping[str, Any]] = []
    called = False

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        nonlocal called
        called = True

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    # what a plain uvicorn protocol (not DeviceHttpProtocol) would hand over
    scope = {"type": "http", "client": ("127.0.0.1", 40000), "path": "/", "state": {}}
    asyncio.run(DeviceScope(app)(scope, receive, send))
    assert not called
    assert sent[0]["status"] == 403 and b"no verified device certificate" in sent[1]["body"]


def test_missing_files_name_the_command_that_makes_them(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(certs.CertsError, match="ctxfuse certs server"):
        server_context(tmp_path)
    with pytest.raises(certs.CertsError, match="ctxfuse certs issue"):
        client_context(pki.root, "nobody")
    with pytest.raises(certs.InvalidNameError):
        client_context(pki.root, "../alpha")
