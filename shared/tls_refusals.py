"""A log line for every handshake the edge listener refuses, with the reason and the device that
offered its certificate (see log_refusals)."""

from __future__ import annotations

import ssl
import weakref

import structlog
from cryptography import x509
from cryptography.x509.oid import NameOID

LOGGER = "ctxfuse.edge_tls"

_ALERT, _HANDSHAKE, _CERTIFICATE, _FATAL = 21, 22, 11, 2
# why the gateway refused, by the TLS alert it sent (RFC 8446 section 6); others are logged by name
_REASONS = {
    44: "certificate revoked",
    48: "unknown CA",
    116: "no certificate",  # certificate_required (TLS 1.3)
    45: "certificate expired",
    43: "certificate not for client use",  # unsupported_certificate, e.g. a server certificate
    42: "bad certificate",
    51: "bad signature",  # decrypt_error
    70: "TLS version below 1.3",  # protocol_version
}


def log_refusals(context: ssl.SSLContext) -> None:
    """Log each fatal TLS alert the context sends (a refused handshake) with its reason.

    asyncio's and uvloop's SSL transports drop handshake errors (logged only in loop debug mode), and
    uvicorn never sees a connection whose handshake failed. The alert the server sends is what carries
    the reason (certificate_revoked, unknown_ca, certificate_required), and OpenSSL reports it through
    the context's message callback, whichever event loop drives the SSLObject. The client's own
    Certificate message, seen just before, names the device. The peer address is not known at this
    layer (the SSLObject has no socket)."""
    context._msg_callback = _RefusalLog()  # type: ignore[attr-defined]


class _RefusalLog:
    def __init__(self) -> None:
        # the client's first certificate (DER), per handshake; dropped with the SSLObject
        self._offered: weakref.WeakKeyDictionary[object, bytes] = weakref.WeakKeyDictionary()

    def __call__(
        self, conn: object, direction: str, version: int, content: int, kind: int, data: bytes
    ) -> None:
        # ssl's wrapper passes `kind` as an IntEnum where it knows the value (the alert's name)
        try:
            if content == _HANDSHAKE and kind == _CERTIFICATE and direction == "read":
                der = _first_certificate(data, tls13=version >= ssl.TLSVersion.TLSv1_3)
                if der:
                    self._offered[conn] = der
            elif content == _ALERT and len(data) >= 2 and data[0] == _FATAL:
                self._log(direction, kind, self._offered.pop(conn, None))
        except Exception:
            # raised here, it would surface inside OpenSSL's handshake and break it: a log line is
            # not worth a connection
            return

    @staticmethod
    def _log(direction: str, alert: int, der: bytes | None) -> None:
        name = getattr(alert, "name", str(alert)).lower()
        # a fresh logger each time: a proxy cached before structlog was (re)configured would keep the
        # old configuration, and refusals are rare enough that the lookup costs nothing
        log = structlog.get_logger(LOGGER)
        if direction == "read":
            log.info("edge_tls_aborted_by_client", alert=name)
            return
        device, serial = _describe(der)
        reason = _REASONS.get(int(alert), name.replace("_", " "))
        log.warning("edge_tls_refused", reason=reason, alert=name, device=device, serial=serial)


def _first_certificate(message: bytes, *, tls13: bool) -> bytes | None:
    # Certificate handshake message: type(1) length(3) [TLS 1.3: context_length(1) context]
    # list_length(3), then entries of length(3) DER [TLS 1.3: extensions]
    pos = 4 + (1 + message[4] if tls13 else 0) + 3
    length = int.from_bytes(message[pos : pos + 3], "big")
    der = message[pos + 3 : pos + 3 + length]
    return der if length and len(der) == length else None


def _describe(der: bytes | None) -> tuple[str | None, str | None]:
    if der is None:
        return None, None
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError:
        return None, None
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return (str(cns[0].value) if cns else None), format(cert.serial_number, "x")
