"""API-key check: with a key configured, every API route needs `Authorization: Bearer KEY`.

Probes and scrapes (/health, /ready, /metrics) and the OpenAPI document stay open. The comparison is
constant-time (hmac.compare_digest on bytes), so response timing does not reveal how much of a guessed
key was right.
"""

from __future__ import annotations

import hmac

from litestar.types import ASGIApp, Receive, Scope, Send

from .encoding import encode
from .errors import AuthenticationError

_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
_OPEN_PREFIXES = ("/schema",)


class RequireApiKey:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(scope["path"]) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        err = AuthenticationError(
            "missing or wrong API key: send `Authorization: Bearer <key>` with the key this server was "
            "started with"
        )
        await send(
            {
                "type": "http.response.start",
                "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")],
            }
        )
        await send({"type": "http.response.body", "body": encode(err.to_openai()), "more_body": False})

    @staticmethod
    def _is_open(path: str) -> bool:
        return path in _OPEN_PATHS or path.startswith(_OPEN_PREFIXES)

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected)
        return False
