"""The router's credential at each backend: every request the fleet's HTTP client sends to a backend
(proxied work, health checks, block-event polls) carries `Authorization: Bearer KEY`, the backend's
own key or else the fleet's `backend_key`. Workers require it (gateway/app.py), so their /internal
routes are never open to whoever reaches them; a foreign OpenAI-compatible server gets its own key.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import httpx

from gateway.backends.fleet.config import BackendSpec


def credential(spec: BackendSpec, backend_key: str | None) -> str | None:
    """The Authorization header the router presents to the backend `spec` names, if any."""
    key = spec.api_key or backend_key
    return f"Bearer {key}" if key else None


class BackendAuth(httpx.Auth):
    def __init__(self, backends: Callable[[], Sequence[BackendSpec]], backend_key: str | None) -> None:
        """`backends`: the fleet's backends now (discovery adds and drops them as it runs)."""
        self._backends = backends
        self._backend_key = backend_key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        url = str(request.url)
        for spec in self._backends():
            if url == spec.url or url.startswith(spec.url + "/"):
                if (value := credential(spec, self._backend_key)) is not None:
                    request.headers["Authorization"] = value
                break
        yield request
