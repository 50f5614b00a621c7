"""The agent's link to the gateway: one kept-alive mutual-TLS connection pool, edge requests in
msgpack, and the 409 path (send what the gateway lacks, retry once). Bytes sent are counted after
dedup and compression, which is what the link costs."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import structlog

from shared.edge_protocol import MSGPACK
from shared.keep_alive import CLIENT_KEEP_ALIVE_S

from .acked import AckedChunks
from .encode import ChunkMemo, Endpoint, Outgoing, chunk_strings

EDGE_PATH = "/edge/v1/request"

# the connection broke after it was open: closed under a request, reset, or cut mid-write
_BROKEN = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)

log = structlog.get_logger("ctxfuse.edge")


class GatewayUnreachable(Exception):
    """No answer from the gateway (refused, timed out, TLS failed): the app gets a 503."""


class Uplink:
    def __init__(
        self, base_url: str, tls: ssl.SSLContext, acked: AckedChunks, threshold: int, connect_timeout_s: float
    ) -> None:
        self.acked = acked
        self.threshold = threshold
        self.uploaded_bytes = 0
        self._memo = ChunkMemo()
        # generation can take minutes: no read timeout; a dead link shows at connect or write
        timeout = httpx.Timeout(connect=connect_timeout_s, read=None, write=30.0, pool=connect_timeout_s)
        limits = httpx.Limits(
            max_connections=16, max_keepalive_connections=4, keepalive_expiry=CLIENT_KEEP_ALIVE_S
        )
        self._client = httpx.AsyncClient(base_url=base_url, verify=tls, timeout=timeout, limits=limits)

    async def forward(self, endpoint: Endpoint, body: Any) -> httpx.Response:
        """POST the app's request over the edge link; the response is streamed (the caller closes it)."""
        out = chunk_strings(endpoint, body, self.threshold, self._memo)
        held = self.acked.known(out.digests)
        out.attach([d for d in out.digests if d not in held])
        resp = await self._post(out)
        if resp.status_code == 409:
            missing = await _missing(resp)
            if missing and all(d in out.chunks for d in missing):
                self.acked.forget(missing)
                out.attach(missing)
                resp = await self._post(out)
        if resp.status_code != 409 and resp.status_code < 500:
            # the gateway stores a request's chunks before it checks anything else: it holds them all
            self.acked.add(out.digests)
        return resp

    async def get(self, path: str) -> httpx.Response:
        return await self.request("GET", path)

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """A plain call to the gateway (the Batch API), read whole; httpx's keywords as they are."""
        return await self._send(lambda: self._client.build_request(method, path, **kw), stream=False)

    async def _post(self, out: Outgoing) -> httpx.Response:
        content = msgspec.msgpack.encode(out.request)
        self.uploaded_bytes += len(content)
        headers = {"content-type": MSGPACK}
        return await self._send(
            lambda: self._client.build_request("POST", EDGE_PATH, content=content, headers=headers),
            stream=True,
        )

    async def _send(self, build: Callable[[], httpx.Request], stream: bool) -> httpx.Response:
        """Send; if the connection broke before an answer came (a kept-alive connection the
        gateway closed as it was reused, see shared/keep_alive.py), once more, on another connection.
        Edge requests are safe to repeat: the gateway stores chunks by digest, and the Batch API's
        creates carry an Idempotency-Key. A refused or timed-out connect is not retried: the link is
        down, and the app hears so at once."""
        try:
            return await self._client.send(build(), stream=stream)
        except _BROKEN as exc:
            log.info("uplink_resend", why=_why(exc))
        except httpx.TransportError as exc:
            raise GatewayUnreachable(_why(exc)) from exc
        try:
            return await self._client.send(build(), stream=stream)
        except httpx.TransportError as exc:
            raise GatewayUnreachable(_why(exc)) from exc

    async def close(self) -> None:
        await self._client.aclose()


async def _missing(resp: httpx.Response) -> list[bytes]:
    try:
        body = msgspec.json.decode(await resp.aread())
        return [bytes.fromhex(h) for h in body.get("missing", [])]
    except (msgspec.DecodeError, ValueError, AttributeError, TypeError):
        return []
    finally:
        await resp.aclose()


def _why(exc: httpx.TransportError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
