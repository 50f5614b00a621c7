"""Who may use the agent's local port. The agent speaks for the device (its certificate opens the
gateway), so "anything that can reach 127.0.0.1" is too many callers: a web page in a browser on the
device is one. It cannot read our answers cross-origin, but it can send simple requests (text/plain
or multipart bodies need no CORS preflight), and with DNS rebinding (its own name re-pointed at
127.0.0.1) its requests are same-origin and it reads everything. So, before any route runs:

1. the Host header must name this agent: localhost, 127.0.0.1 or [::1], or a configured name (the
   port is ignored). A rebound page sends its own name, and gets a 403.
2. a request with an Origin header (browsers send one on every cross-origin request and every POST)
   is refused with 403 unless the origin is on the allow list (empty by default). Allowed origins get
   CORS answers, preflight included, so a page we chose can use the agent.
3. with a key configured, `Authorization: Bearer KEY` (compared in constant time), as the gateway
   asks for it; /health and /metrics stay open, as the gateway's do.
4. a route that takes JSON refuses any other Content-Type with 415 (only the Files upload takes
   multipart), so no body a page can send without a preflight reaches a JSON route.

Refusals are in OpenAI's error shape, as every answer of the agent.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
import structlog
from litestar.enums import ScopeType
from litestar.types import ASGIApp, HTTPScope, Message, Receive, Scope, Send

log = structlog.get_logger("ctxfuse.edge")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
_OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes, as on the gateway
_MULTIPART_PATHS = frozenset({"/v1/files"})  # the Files upload: multipart/form-data, as OpenAI's
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_CORS_METHODS = b"GET, POST, DELETE"
_CORS_HEADERS = b"authorization, content-type, idempotency-key"
_CORS_MAX_AGE_S = b"600"


def host_name(value: str) -> str:
    """The name of a Host header (or a configured host), lowercased, without its port:
    `LocalHost:8100` -> `localhost`, `[::1]:8100` -> `[::1]`, `::1` -> `[::1]`."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        return v[: end + 1] if end > 0 else v
    if v.count(":") > 1:  # a bare IPv6 address (a Host header brackets it; a config may not)
        return f"[{v}]"
    return v.partition(":")[0]


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the port on this machine (a name other than localhost is not
    resolved: it counts as exposed)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    message: str
    code: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class GuardPolicy:
    api_key: str | None = field(default=None, repr=False)
    hosts: frozenset[str] = frozenset(LOOPBACK_HOSTS)
    origins: frozenset[str] = frozenset()

    @classmethod
    def of(cls, api_key: str | None, hosts: Iterable[str], origins: Iterable[str]) -> GuardPolicy:
        """The loopback names always; `hosts` and `origins` as configured (ports of hosts ignored)."""
        return cls(
            api_key=api_key or None,
            hosts=frozenset([*LOOPBACK_HOSTS, *(host_name(h) for h in hosts)]),
            origins=frozenset(_origin(o) for o in origins),
        )


def _origin(value: str) -> str:
    return value.strip().lower().rstrip("/")


@dataclass(frozen=True, slots=True)
class _Seen:
    """The headers the guard decides on, read once."""

    hosts: list[str]
    origin: str | None
    authorization: bytes | None
    content_type: str
    declares_body: bool
    preflight: bool

    @classmethod
    def of(cls, scope: HTTPScope) -> _Seen:
        hosts: list[str] = []
        origin = authorization = None
        content_type, declares_body, preflight = "", False, False
        for name, value in scope["headers"]:
            if name == b"host":
                hosts.append(value.decode("latin-1"))
            elif name == b"origin":
                origin = value.decode("latin-1")
            elif name == b"authorization":
                authorization = value
            elif name == b"content-type":
                content_type = value.decode("latin-1").partition(";")[0].strip().lower()
            elif name == b"content-length":
                declares_body = declares_body or value.strip() not in (b"", b"0")
            elif name == b"transfer-encoding":
                declares_body = True
            elif name == b"access-control-request-method":
                preflight = scope["method"] == "OPTIONS"
        return cls(hosts, origin, authorization, content_type, declares_body, preflight)


class LocalGuard:
    """ASGI middleware in front of the agent's app: the four checks above, in that order."""

    def __init__(self, app: ASGIApp, policy: GuardPolicy) -> None:
        self.app = app
        self.policy = policy
        self._expected = f"Bearer {policy.api_key}".encode() if policy.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == ScopeType.HTTP:
            await self._http(scope, receive, send)
        elif (
            scope["type"] == ScopeType.WEBSOCKET
        ):  # the agent serves none: refused, never passed on unchecked
            await send({"type": "websocket.close", "code": 1008, "reason": ""})
        else:  # lifespan: the app's own
            await self.app(scope, receive, send)

    async def _http(self, scope: HTTPScope, receive: Receive, send: Send) -> None:
        seen = _Seen.of(scope)
        refusal = self._refusal(scope, seen)
        if refusal is not None:
            await _send_error(send, refusal)
            return
        if seen.origin is None:
            await self.app(scope, receive, send)
            return
        cors = _cors_headers(seen.origin)
        if seen.preflight:  # an allowed page asks before it sends JSON or a key: yes, with no body
            headers = [*cors, (b"access-control-allow-methods", _CORS_METHODS)]
            headers += [(b"access-control-allow-headers", _CORS_HEADERS)]
            headers += [(b"access-control-max-age", _CORS_MAX_AGE_S)]
            await send({"type": "http.response.start", "status": 204, "headers": headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _refusal(self, scope: HTTPScope, seen: _Seen) -> Refusal | None:
        if len(seen.hosts) != 1:
            return Refusal(400, "send exactly one Host header", "invalid_host")
        if host_name(seen.hosts[0]) not in self.policy.hosts:
            allowed = ", ".join(sorted(self.policy.hosts))
            why = f"this agent answers only for the host names {allowed}; add more with --allowed-host"
            return Refusal(403, why, "host_not_allowed")
        if seen.origin is not None and _origin(seen.origin) not in self.policy.origins:
            why = "requests from web pages are refused unless their origin is allowed (--allowed-origin)"
            return Refusal(403, why, "origin_not_allowed")
        if seen.preflight:
            return None
        return self._key_refusal(scope, seen) or _type_refusal(scope, seen)

    def _key_refusal(self, scope: HTTPScope, seen: _Seen) -> Refusal | None:
        if self._expected is None or scope["path"] in _OPEN_PATHS:
            return None
        if seen.authorization is not None and hmac.compare_digest(seen.authorization, self._expected):
            return None
        why = "missing or wrong API key: send `Authorization: Bearer <key>` with the agent's key"
        return Refusal(401, why, "invalid_api_key", ((b"www-authenticate", b"Bearer"),))


def _type_refusal(scope: HTTPScope, seen: _Seen) -> Refusal | None:
    """A JSON route takes application/json only, or no body at all (a cancel)."""
    if scope["method"] not in _BODY_METHODS or scope["path"] in _MULTIPART_PATHS:
        return None
    if seen.content_type == "application/json" or not (seen.content_type or seen.declares_body):
        return None
    why = f"send the body as application/json (got {seen.content_type or 'no Content-Type'})"
    return Refusal(415, why, "unsupported_media_type")


def _cors_headers(origin: str) -> list[tuple[bytes, bytes]]:
    return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]


async def _send_error(send: Send, refusal: Refusal) -> None:
    body = {
        "error": {
            "message": refusal.message,
            "type": "invalid_request_error",
            "param": None,
            "code": refusal.code,
        }
    }
    headers = [(b"content-type", b"application/json"), *refusal.headers]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": msgspec.json.encode(body), "more_body": False})


def warn_if_exposed(host: str, api_key: str | None) -> None:
    """`--host 0.0.0.0` (or any address off loopback) puts the device's identity on the network."""
    if is_loopback(host):
        return
    log.warning(
        "agent_port_exposed",
        host=host,
        api_key="set" if api_key else "NONE: anyone who reaches the port speaks as this device",
        hint="the agent's port carries this device's identity to the gateway; bind 127.0.0.1 unless "
        "other machines must use it, then set --api-key and list their Host names with --allowed-host",
    )
