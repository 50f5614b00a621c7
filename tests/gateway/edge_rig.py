"""What tests of the edge listener share: one edge-link request sent as a device sends it."""

from __future__ import annotations

import httpx
import msgspec

from shared.edge_protocol import MSGPACK, EdgeRequest


def send_edge_request(device: httpx.Client, url: str, req: EdgeRequest) -> httpx.Response:
    """POST `req` (msgpack) to the edge listener at `url` over the device's mutual-TLS client."""
    body = msgspec.msgpack.encode(req)
    return device.post(f"{url}/edge/v1/request", content=body, headers={"content-type": MSGPACK})
