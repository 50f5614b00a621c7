"""The router's credential at each backend: every request the fleet's HTTP client sends to a backend
(proxied work, health checks, block-event polls) carries `Authorization: Bearer KEY`, the backend's
own key or else the fleet's `backend_key`. Workers require it (gateway/app.py), so their /internal
routes are never open to whoever reaches them; a foreign OpenAI-compatible server gets its own key.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import httpx

from gateway.backends.fleet.config import BackendSpec


class BackendAuth(httpx.Auth):
    def __init__(self, backends: Callable[[], Sequence[BackendSpec]], backend_key: str | None) -> None:
        """`backends`: the fleet's backends now (discovery adds and drops them as it runs)."""
        self._backends = backends
        self._backend_key = backend_key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        url = str(request.url)
        for spec in self._backends():
            base, key = spec.url, spec.api_key or self._backend_key
            if key and (url == base or url.startswith(base + "/")):
                request.headers["Authorization"] = f"Bearer {key}"
                break
        yield request
