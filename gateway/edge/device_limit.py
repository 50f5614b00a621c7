"""A per-device bound on requests in flight on the edge listener: one busy or misbehaving device
cannot take the whole engine. Counted over the whole ASGI call, so a streamed answer holds its slot
until its last byte; over the bound a request gets a 429 in OpenAI's shape with Retry-After."""

from __future__ import annotations

from collections import defaultdict

from litestar.types import ASGIApp, Receive, Scope, Send

from gateway.encoding import encode
from shared.errors import QueueFullError
from shared.tls import DEVICE_STATE_KEY


class DeviceLimit:
    def __init__(self, app: ASGIApp, max_in_flight: int) -> None:
        self.app = app
        self.max_in_flight = max_in_flight
        self.in_flight: defaultdict[str, int] = defaultdict(int)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        device = scope.get("state", {}).get(DEVICE_STATE_KEY)
        if scope["type"] != "http" or not isinstance(device, str):
            await self.app(scope, receive, send)
            return
        if self.in_flight[device] >= self.max_in_flight:
            await _refuse(send, device, self.max_in_flight)
            return
        self.in_flight[device] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[device] -= 1
            if not self.in_flight[device]:
                del self.in_flight[device]


async def _refuse(send: Send, device: str, limit: int) -> None:
    err = QueueFullError(f"device {device} already has {limit} requests in flight; retry when one ends")
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")],
        }
    )
    await send({"type": "http.response.body", "body": encode(err.to_openai()), "more_body": False})
