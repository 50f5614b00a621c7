"""Who is calling, and may they: the OpenAI port's authentication and per-key admission, as ASGI
middleware in front of every API route.

A caller presents `Authorization: Bearer KEY`:
- a tenant's key from the key store (`ctxfuse keys create`): the request runs as that tenant, under
  that key's limits (gateway/access/limits.py) and allowed models;
- the server's own `--api-key` (the single-tenant shortcut): tenant `default`, no limits;
- with neither configured (no `--api-key`, no key in the store) the server is open: tenant
  `default`. As soon as one key exists, a key is required.
Anything else is 401. Requests over a key's requests-per-minute or in-flight limit are answered 429
with `Retry-After` before they reach a route; every answer to a limited key carries OpenAI's
`x-ratelimit-*` headers. Probes and scrapes (/health, /ready, /metrics), the OpenAPI document and
the console's page (/console and its static files: no data; its API is the operator's) stay open.

The route reads the caller from `request.state.principal` (and the admission ticket, for the tokens
per minute it reserves once it knows the prompt's size, from `request.state.ticket`).

Key lookups are cached for `LOOKUP_TTL_S`, so SQLite is asked at most once per key and period (on a
worker thread, never on the event loop), and a key revoked with `ctxfuse keys revoke` (another
process) stops working within that period.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.access.keys import KEY_PREFIX, ApiKey, Keys, check_tenant
from gateway.access.limits import Limited, Limiter, SettleOnClose, Ticket
from gateway.encoding import encode
from gateway.errors import AuthenticationError, PermissionDeniedError, RateLimitError
from shared.errors import CtxfuseError
from shared.tls import DEVICE_STATE_KEY, TENANT_STATE_KEY

DEFAULT_TENANT = "default"
# a device whose certificate names no tenant is a tenant of its own, `device:NAME`: a name no key's
# tenant can take (the tenant name rule allows no ':')
DEVICE_TENANT_PREFIX = "device:"
# the router's word, to a worker, for whose request this is (the worker's prefix-cache partition);
# believed only from a caller holding the worker's own key, i.e. its router
TENANT_HEADER = "x-ctxfuse-tenant"
LOOKUP_TTL_S = 2.0
# the console's page and its static files hold no data (its /console/api/ is the operator's only)
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/console", "/console/"})
_OPEN_PREFIXES = ("/schema", "/console/static/")


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    key: ApiKey | None = None  # None: the server's --api-key, or an open server

    @property
    def cache_salt(self) -> str | None:
        """The caller's partition of the prefix cache: its tenant's name (None for the default tenant,
        the only one of a server with no tenant keys)."""
        return None if self.tenant == DEFAULT_TENANT else self.tenant

    def check_model(self, model: str | None) -> None:
        """403 when the key may not use `model` (None: the request names none and the server has no
        default to check, so a key limited to some models must name one)."""
        allowed = self.key.limits.models if self.key is not None else None
        if allowed is not None and model not in allowed:
            raise PermissionDeniedError(
                f"this API key may not use the model {model!r} (allowed: {', '.join(allowed)})"
                if model is not None
                else f"this API key may use only some models; name one of them ({', '.join(allowed)})",
                param="model",
            )


def principal_of(state: Any) -> Principal:
    """The caller of a request (`request.state`): as the middleware found it; on the edge listener
    the verified device's tenant, as its certificate names it (`ctxfuse certs issue --tenant`), so a
    tenant's devices and keys share its data, or for a device issued without one a tenant of its own
    (`device:NAME`); else the default tenant (an app built without the middleware)."""
    p = getattr(state, "principal", None)
    if isinstance(p, Principal):
        return p
    device = getattr(state, DEVICE_STATE_KEY, None)
    if isinstance(device, str):
        tenant = getattr(state, TENANT_STATE_KEY, None)
        return Principal(tenant if isinstance(tenant, str) else DEVICE_TENANT_PREFIX + device)
    return Principal(DEFAULT_TENANT)


class Authenticate:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        keys: Keys | None,
        limiter: Limiter,
        clock: Callable[[], float] = time.monotonic,
        trust_tenant_header: bool = False,
    ) -> None:
        self.app = app
        self._trust_tenant_header = trust_tenant_header
        self._api_key = None if api_key is None else hashlib.sha256(api_key.encode()).digest()
        self._keys = keys
        self.limiter = limiter
        self._clock = clock
        self._cache: dict[bytes, tuple[float, ApiKey | None]] = {}
        self._any_key: tuple[float, bool] = (-1e18, False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or _is_open(scope["path"]):
            await self.app(scope, receive, send)
            return
        try:
            principal = await self._principal(_bearer(scope))
        except CtxfuseError as exc:  # the shared key store cannot be reached: refused, never let in
            await _refuse(send, exc, [])
            return
        if principal is not None and principal.key is None and self._trust_tenant_header:
            principal = _forwarded_tenant(scope) or principal
        if principal is None:
            await _refuse(send, AuthenticationError(_WHO), [(b"www-authenticate", b"Bearer")])
            return
        state = scope.setdefault("state", {})
        state["principal"] = principal
        key = principal.key
        if key is None:
            await self.app(scope, receive, send)
            return
        try:
            ticket = await self.limiter.admit(key)
        except CtxfuseError as exc:  # the shared limits cannot be reached: refused, never unlimited
            await _refuse(send, exc, [])
            return
        if isinstance(ticket, Limited):
            headers = [(b"retry-after", str(max(1, round(ticket.retry_after_s))).encode())]
            await _refuse(send, RateLimitError(ticket.message), headers + await self.limiter.headers(key))
            return
        state["ticket"] = ticket

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                # counted as the answer starts: this request's tokens included (reserved, or used
                # when its answer is whole)
                extra = await self.limiter.headers(key, ticket)
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_limits)
        finally:
            self.limiter.release(ticket)

    async def _principal(self, token: bytes | None) -> Principal | None:
        if (
            token is not None
            and self._api_key is not None
            and hmac.compare_digest(hashlib.sha256(token).digest(), self._api_key)
        ):
            return Principal(DEFAULT_TENANT)
        if token is not None and token.startswith(KEY_PREFIX.encode()) and self._keys is not None:
            key = await self._lookup(token)
            if key is not None:
                return Principal(key.tenant, key)
            return None
        if self._api_key is None and not await self._store_has_keys():
            return Principal(DEFAULT_TENANT)  # an open server
        return None

    async def _lookup(self, token: bytes) -> ApiKey | None:
        now = self._clock()
        digest = hashlib.sha256(token).digest()
        hit = self._cache.get(digest)
        if hit is not None and now - hit[0] < LOOKUP_TTL_S:
            return hit[1]
        assert self._keys is not None
        try:
            key = await asyncio.to_thread(self._keys.lookup, token.decode("ascii"))
        except UnicodeDecodeError:
            key = None
        if len(self._cache) > 10_000:
            self._cache.clear()  # a flood of made-up keys must not grow the cache without bound
        self._cache[digest] = (now, key)
        return key

    async def _store_has_keys(self) -> bool:
        now = self._clock()
        at, has = self._any_key
        if now - at >= LOOKUP_TTL_S:
            has = self._keys is not None and await asyncio.to_thread(self._keys.has_keys)
            self._any_key = (now, has)
        return has


_WHO = (
    "missing or wrong API key: send `Authorization: Bearer <key>` with a key from `ctxfuse keys create` "
    "or the key this server was started with"
)


def _forwarded_tenant(scope: Scope) -> Principal | None:
    for name, value in scope["headers"]:
        if name == TENANT_HEADER.encode():
            tenant = value.decode("latin-1")
            if tenant.startswith(DEVICE_TENANT_PREFIX) or _is_tenant(tenant):
                return Principal(tenant)
    return None


def _is_tenant(name: str) -> bool:
    try:
        check_tenant(name)
    except CtxfuseError:
        return False
    return True


def _is_open(path: str) -> bool:
    return path in _OPEN_PATHS or path.startswith(_OPEN_PREFIXES)


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


async def _refuse(send: Send, err: CtxfuseError, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": encode(err.to_openai()), "more_body": False})


async def reserve_tokens(state: Any, limiter: Limiter, tokens: int) -> Ticket | None:
    """Reserve a dispatched request's most tokens against its key's tokens per minute; raises 429
    when they do not fit. The ticket to settle at the end (None: nothing reserved)."""
    principal, ticket = principal_of(state), getattr(state, "ticket", None)
    if principal.key is None or not isinstance(ticket, Ticket):
        return None
    refused = await limiter.reserve(principal.key, ticket, tokens)
    if refused is not None:
        raise RateLimitError(refused.message, retry_after_s=refused.retry_after_s)
    return ticket


async def reserve_settled(
    state: Any, limiter: Limiter, prompt_tokens: int, most_tokens: int
) -> SettleOnClose | None:
    """Reserve a request's most tokens (429 when they do not fit); what settles the reservation to
    the real count (prompt + generated) when its generations close. None: the key has no limits."""
    ticket = await reserve_tokens(state, limiter, most_tokens)
    return None if ticket is None else SettleOnClose(limiter, ticket, prompt_tokens)
