"""The edge listener's per-device bound: a device over its share gets a 429 with Retry-After while
its requests run (streamed ones until their last byte); other devices are not affected."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from gateway.edge.device_limit import DeviceLimit


class Held:
    """An ASGI app whose requests stay in flight until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def call(app: DeviceLimit, device: str) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "http", "state": {"device": device}}, None, send)
    return sent


def test_a_device_over_its_share_is_refused_until_one_ends() -> None:
    async def scenario() -> None:
        held = Held()
        limit = DeviceLimit(held, 2)  # type: ignore[arg-type]
        running = [asyncio.ensure_future(call(limit, "cam")) for _ in range(2)]
        await asyncio.sleep(0)
        refused = await call(limit, "cam")
        assert refused[0]["status"] == 429 and (b"retry-after", b"1") in refused[0]["headers"]
        assert msgspec.json.decode(refused[1]["body"])["error"]["code"] == "queue_full"
        other = asyncio.ensure_future(call(limit, "drone"))  # another device has its own share
        await asyncio.sleep(0)
        assert limit.in_flight == {"cam": 2, "drone": 1}
        held.release.set()
        for done in await asyncio.gather(*running, other):
            assert done[0]["status"] == 200
        assert limit.in_flight == {}
        assert (await call(limit, "cam"))[0]["status"] == 200

    asyncio.run(scenario())
