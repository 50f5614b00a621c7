"""The floor under the router's cost: the least a relay in this stack can do, measured beside it.

`BareRelay` is a raw ASGI app on the router's own server (uvicorn, with uvloop and httptools as
`ctxfuse serve` takes them) that reads a request's body whole, sends it to one upstream through the
router's own HTTP client (gateway/backends/fleet/wire.py) and relays the answer as it arrives: no
framework, no decoding, no authentication, no routing, no keys, no log line, no metric. What it
adds before an instant upstream is what any relay written on this stack pays on this machine (two
loopback hops, two HTTP parses, the body moved twice); the router's figure beyond it is the router's
own work. `ctxfuse bench gateway --fleet` measures it beside the router (router_overhead.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gateway.backends.fleet.wire import WireClient, WireError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class BareRelay:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.client: WireClient | None = None  # made on the server's loop, at the first request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if self.client is None:
            self.client = WireClient(connect_timeout_s=5.0, read_timeout_s=60.0, keep_alive_s=30.0)
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            answer = await self.client.post(
                self.upstream + scope["path"], b"".join(parts), {"content-type": "application/json"}
            )
        except WireError as exc:
            body = str(exc).encode()
            await send({"type": "http.response.start", "status": 502, "headers": []})
            await send({"type": "http.response.body", "body": body})
            return
        headers = [(b"content-type", (answer.headers.get("content-type") or "text/plain").encode())]
        await send({"type": "http.response.start", "status": answer.status_code, "headers": headers})
        try:
            async for chunk in answer.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            await answer.aclose()
        await send({"type": "http.response.body", "body": b""})
