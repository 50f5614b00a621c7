"""Mutual TLS for the gateway's edge listener: the server and client contexts, live CRL reloads,
a log line for every refused handshake, and the verified device name carried to the ASGI app.

Reads the layout `shared.certs` writes (`TLSDir`). The edge listener speaks TLS 1.3 only and issues no
session tickets. This is deliberate: a resumed session skips certificate verification, so a device
could resume a session made before it was revoked. TLS 1.2's server-side session cache cannot be
switched off from Python, so TLS 1.2 is refused; with no tickets there is nothing to resume, and every
connection is checked against the current CRL.

A revocation also reaches connections already open: every request is checked against the revoked
serials of the current crl.pem (`DeviceScope`), and a revoked device's request gets a 403 and the
connection is closed.

uvicorn internals this relies on (pin `uvicorn[standard]>=0.54,<0.55` and re-run tests/shared on
each upgrade): `Config(ssl_context_factory=...)` (public, new in recent releases); the h11
protocol's constructor (through shared/conn_limits.py), its `connection_made` being called with the
TLS transport once the handshake is done, and its `app_state` attribute being copied into every
request's `scope["state"]`. Python: `SSLContext._msg_callback` (private, present since 3.8) and
`sni_callback`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import structlog
import uvicorn

from shared.ca_files import CertsError, TLSDir, check_device_name, read_cert, read_crl, read_key
from shared.certs import TENANT_URI_PREFIX
from shared.conn_limits import ConnLimits, LimitedH11Protocol, uvicorn_options
from shared.errors import CtxfuseError
from shared.tenant_name import is_tenant_name
from shared.tls_refusals import LOGGER, log_refusals

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEVICE_STATE_KEY = "device"  # scope["state"]["device"]: the verified device name
SERIAL_STATE_KEY = "device_serial"  # scope["state"]["device_serial"]: its certificate's serial (int)
# scope["state"]["device_tenant"]: the tenant its certificate names (absent: a tenant of its own)
TENANT_STATE_KEY = "device_tenant"


def server_context(tls_dir: Path | str) -> ssl.SSLContext:
    """The edge listener's context: TLS 1.3, the server certificate, a client certificate from the CA
    required and checked against the CRL; refused handshakes are logged (`log_refusals`).

    Every file is checked first (shared.ca_files): a missing or damaged one stops the start with one
    line naming it and its fix, rather than OpenSSL's error, or every handshake failing later."""
    d = TLSDir(Path(tls_dir))
    _require(d.server_cert, f"run `ctxfuse certs server {d.root} --host NAME`")
    _require(d.server_key, f"run `ctxfuse certs server {d.root} --host NAME`")
    _require(d.crl, f"run `ctxfuse certs init {d.root}`")
    ca = read_cert(_require(d.ca_cert, f"run `ctxfuse certs init {d.root}`"), d.ca_fix())
    read_key(d.server_key, d.server_fix(), read_cert(d.server_cert, d.server_fix(), issuer=ca))
    read_crl(d, ca)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.num_tickets = 0  # no resumption: see the module docstring
    with _openssl_refuses(d.server_cert, d.server_key):
        ctx.load_cert_chain(d.server_cert, d.server_key)
    with _openssl_refuses(d.ca_cert, d.crl):
        ctx.load_verify_locations(cafile=d.ca_cert)
        ctx.load_verify_locations(cafile=d.crl)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    log_refusals(ctx)
    return ctx


def client_context(tls_dir: Path | str, device_name: str) -> ssl.SSLContext:
    """The edge agent's context: trusts only the CA (and checks the gateway's host name), presents
    devices/NAME.pem. Its files are checked first, as in `server_context`."""
    d = TLSDir(Path(tls_dir))
    ca = _require(d.ca_cert, "copy ca.pem from the CA's directory")
    hint = f"run `ctxfuse certs issue DIR {device_name}` and copy it"
    cert, key = _require(d.device_cert(device_name), hint), _require(d.device_key(device_name), hint)
    fix = d.device_fix(device_name)
    ca_cert = read_cert(ca, "copy ca.pem again from the CA's directory")
    read_key(key, fix, read_cert(cert, fix, issuer=ca_cert))
    with _openssl_refuses(ca, cert, key):
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
        ctx.load_cert_chain(cert, key)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def _require(path: Path, hint: str) -> Path:
    if not path.is_file():
        raise CertsError(f"{path} does not exist: {hint}")
    return path


@contextlib.contextmanager
def _openssl_refuses(*paths: Path) -> Iterator[None]:
    """OpenSSL's refusal of files that passed our checks (a form it does not take) as one line."""
    try:
        yield
    except ssl.SSLError as exc:
        names = ", ".join(str(p) for p in paths)
        raise CertsError(f"OpenSSL cannot load {names} ({exc.reason or exc}): issue them again") from exc


class RevocationWatcher:
    """Keeps a live server context's revocation list current. `refresh()` costs one stat() when
    crl.pem is unchanged; a changed file is added to the context's store, where OpenSSL uses the
    CRL with the latest lastUpdate (shared.certs makes each new one strictly later) for every NEW
    handshake; `revoked` holds the same list's serials, for requests on connections already open."""

    def __init__(self, context: ssl.SSLContext, tls_dir: Path | str) -> None:
        self._context = context
        self._dir = TLSDir(Path(tls_dir))
        self._path = self._dir.crl
        self._ca = read_cert(self._dir.ca_cert, self._dir.ca_fix())  # what each new CRL must be signed by
        # None: the first refresh loads the file even if server_context read this same version
        # (OpenSSL keeps one copy of an identical CRL), so no change between the two is missed
        self._seen: tuple[int, int, int] | None = None
        self.revoked: frozenset[int] = frozenset()

    def refresh(self) -> bool:
        """Load crl.pem again if it changed; True when it did. Raises OSError, ssl.SSLError or a
        CtxfuseError (shared.ca_files.DamagedCAFile, a StorageFault) for a missing, unreadable or
        damaged file, leaving the CRLs already loaded in force: a CRL whose signature does not verify
        would make OpenSSL refuse every device."""
        st = os.stat(self._path)
        # a rename (how shared.certs writes) changes the inode even when mtime's resolution is coarse
        signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        if signature == self._seen:
            return False
        # each crl.pem lists every serial ever revoked (shared.certs rebuilds it from the index)
        crl = read_crl(self._dir, self._ca)
        revoked = frozenset(entry.serial_number for entry in crl)
        self._context.load_verify_locations(cafile=self._path)
        self.revoked = revoked
        self._seen = signature
        return True

    def is_revoked(self, serial: int) -> bool:
        """Whether `serial` is revoked by the current crl.pem (reloaded if it changed). A file that
        cannot be read leaves the list already loaded in force, as for handshakes."""
        self._refresh_or_log()
        return serial in self.revoked

    def refresh_on_every_handshake(self) -> None:
        """Call `refresh()` at the start of each handshake (the context's SNI callback, which runs on
        every ClientHello, with or without a server name), so a revocation applies from the next
        connection on, without a timer."""
        self._context.sni_callback = self._on_client_hello

    def _on_client_hello(self, _conn: ssl.SSLObject, _server_name: str | None, _ctx: ssl.SSLContext) -> None:
        self._refresh_or_log()

    def _refresh_or_log(self) -> None:
        try:
            self.refresh()
        except (OSError, ssl.SSLError, ValueError, CtxfuseError) as exc:
            # an exception here would abort this handshake; keep the CRLs already loaded instead
            log = structlog.get_logger(LOGGER)
            log.error("edge_tls_crl_reload_failed", path=str(self._path), error=str(exc))


class DeviceHttpProtocol(LimitedH11Protocol):
    """uvicorn's h11 protocol under our connection limits (`uvicorn.Config(http=DeviceHttpProtocol)`,
    or `conn_limits.uvicorn_options(limits, DeviceHttpProtocol)`), plus: every request on a
    connection carries the CN of that connection's verified client certificate in
    scope["state"]["device"], its serial in scope["state"]["device_serial"] and, for a certificate
    issued with a tenant, that tenant in scope["state"]["device_tenant"].

    The name travels with the connection: uvicorn copies the protocol's `app_state` into each
    request's scope["state"] (and hands it to WebSocket upgrades), before any middleware runs. It is
    never looked up by address: a lookup by scope["client"] can be pointed at another device's
    connection with X-Forwarded-For whenever uvicorn's proxy headers are on, as they are by default
    for loopback peers.

    With `revocations` bound (edge_listener does), the connection is also closed, idle or not, within
    `revocation_check_s` of its device's revocation: an idle kept-alive connection or a long stream
    does not outlive it."""

    revocations: ClassVar[RevocationWatcher | None] = None
    revocation_check_s: ClassVar[float] = 10.0
    _revocation_timer: asyncio.TimerHandle | None = None  # per connection, once it is made

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        # with CERT_REQUIRED the transport exists only once the certificate was verified
        peercert = transport.get_extra_info("peercert")
        name = _common_name(peercert)
        serial = _serial(peercert) if isinstance(peercert, dict) else None
        if name is not None:
            # this connection's own dict: the one passed in is the lifespan state, shared by all
            state = {**self.app_state, DEVICE_STATE_KEY: name, SERIAL_STATE_KEY: serial}
            tenant = _tenant(peercert)
            if tenant is not None:
                state[TENANT_STATE_KEY] = tenant
            self.app_state = state
        if serial is not None and self.revocations is not None and not transport.is_closing():
            self._check_revocation(serial)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._revocation_timer is not None:
            self._revocation_timer.cancel()
        super().connection_lost(exc)

    def _check_revocation(self, serial: int) -> None:
        self._revocation_timer = None
        if self.transport.is_closing() or self.revocations is None:
            return
        if self.revocations.is_revoked(serial):
            log = structlog.get_logger(LOGGER)
            log.warning("edge_tls_revoked_connection_closed", serial=format(serial, "x"))
            self.transport.close()  # a request still running sees a disconnect and is aborted
            return
        self._revocation_timer = self.loop.call_later(self.revocation_check_s, self._check_revocation, serial)


def _serial(peercert: dict[str, Any]) -> int | None:
    value = peercert.get("serialNumber")
    return int(value, 16) if isinstance(value, str) else None


def _tenant(peercert: object) -> str | None:
    """The tenant a verified certificate names (shared.certs.issue_device's SAN URI). A certificate
    naming none, several or a malformed one gets none: its device is then a tenant of its own, which
    sees only its own data (fail closed)."""
    if not isinstance(peercert, dict):
        return None
    names = [
        value[len(TENANT_URI_PREFIX) :]
        for kind, value in peercert.get("subjectAltName", ())
        if kind == "URI" and isinstance(value, str) and value.startswith(TENANT_URI_PREFIX)
    ]
    if len(names) != 1 or not is_tenant_name(names[0]):
        return None
    return names[0]


def _common_name(peercert: object) -> str | None:
    if not isinstance(peercert, dict):
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                try:
                    return check_device_name(value)
                except CertsError:
                    return None
    return None


class DeviceScope:
    """ASGI middleware that guarantees scope["state"]["device"] (Litestar: `request.state.device`)
    on every HTTP and WebSocket request, as `DeviceHttpProtocol` set it. A request without one is
    refused (403, or WebSocket close 1008), never served anonymously: it means the listener runs
    without `DeviceHttpProtocol`, or the certificate's CN is not a device name.

    With a `watcher`, every request is also checked against the current revocation list: a kept-alive
    connection outlives its handshake, so a device revoked after it connected is refused on its next
    request (403, `Connection: close`), not only on its next handshake."""

    def __init__(self, app: ASGIApp, watcher: RevocationWatcher | None = None) -> None:
        self.app = app
        self.watcher = watcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            state = scope.get("state", {})
            name = state.get(DEVICE_STATE_KEY)
            log = structlog.get_logger(LOGGER)
            if not isinstance(name, str):
                log.error("edge_tls_no_device", client=scope.get("client"), path=scope.get("path"))
                await _refuse(scope, send, "no verified device certificate")
                return
            serial = state.get(SERIAL_STATE_KEY)
            # fail closed: with a watcher, a connection whose serial is unknown is not served either
            if self.watcher is not None and (not isinstance(serial, int) or self.watcher.is_revoked(serial)):
                log.warning("edge_tls_revoked_on_open_connection", device=name, serial=_hex(serial))
                await _refuse(scope, send, "this device's certificate is revoked")
                return
        await self.app(scope, receive, send)


def _hex(serial: object) -> str | None:
    return format(serial, "x") if isinstance(serial, int) else None


async def _refuse(scope: Scope, send: Send, message: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    error = {"message": message, "type": "permission_error", "param": None, "code": None}
    body = json.dumps({"error": error}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),  # nothing more is served on this connection
    ]
    await send({"type": "http.response.start", "status": 403, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True, slots=True)
class EdgeListener:
    config: uvicorn.Config
    context: ssl.SSLContext
    watcher: RevocationWatcher


def edge_listener(
    app: ASGIApp,
    tls_dir: Path | str,
    *,
    host: str,
    port: int,
    limits: ConnLimits | None = None,
    revocation_check_s: float = DeviceHttpProtocol.revocation_check_s,
    **options: Any,
) -> EdgeListener:
    """A uvicorn config for the edge listener: mutual TLS from `tls_dir`, the CRL reloaded on every
    handshake, checked on every request and every `revocation_check_s` on each open connection, the
    device name in each request's scope, connections under `limits` (default ConnLimits()). `options`
    go to uvicorn.Config unchanged.

    Proxy headers are off: TLS ends here, so no trusted proxy can stand in front, and scope["client"]
    (in logs, and any per-address limit) must be the real peer, not what a device's X-Forwarded-For
    says."""
    context = server_context(tls_dir)
    watcher = RevocationWatcher(context, tls_dir)
    watcher.refresh()  # the revoked serials, now: an unreadable crl.pem stops the start, not a request
    watcher.refresh_on_every_handshake()
    config = uvicorn.Config(
        DeviceScope(app, watcher),
        host=host,
        port=port,
        ssl_context_factory=lambda _config, _default: context,
        proxy_headers=False,
        **uvicorn_options(
            limits or ConnLimits(),
            DeviceHttpProtocol,
            revocations=watcher,
            revocation_check_s=revocation_check_s,
        ),
        **options,
    )
    return EdgeListener(config, context, watcher)
