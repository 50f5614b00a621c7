"""The uplink survives a kept-alive connection that breaks as it is reused.

The gateway closes a connection it has kept idle for a while; an agent that sends on it in that same
instant gets "server disconnected without sending a response" (this broke a CI run: an app's request
failed with 503 while the gateway was up). The peer below makes that instant certain: it speaks real
HTTP/1.1 over real mutual TLS, answers a connection's first request, and closes the connection on
reading the next one without a word, which is what the gateway's side of the race looks like.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from edge.acked import AckedChunks
from edge.uplink import GatewayUnreachable, Uplink
from shared.certs import init_ca, issue_device, issue_server
from shared.tls import client_context, server_context

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
REPLY = b'{"ok":true}'


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tls = tmp_path_factory.mktemp("tls")
    init_ca(tls)
    issue_server(tls, ["127.0.0.1"])
    issue_device(tls, "dev1")
    return tls


class ClosingPeer:
    """Answers the first `answer_first` requests of each connection, then closes it on the next."""

    def __init__(self, answer_first: int) -> None:
        self.answer_first = answer_first
        self.connections = 0
        self.answered = 0
        self.dropped = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered_here = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(_content_length(head))
                if answered_here == self.answer_first:
                    self.dropped += 1
                    return
                answered_here += 1
                self.answered += 1
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(REPLY)}\r\n\r\n".encode()
                    + REPLY
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            return
        finally:
            writer.close()


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


Call = Callable[[Uplink], Awaitable[httpx.Response]]


async def _forward(uplink: Uplink) -> httpx.Response:
    resp = await uplink.forward("chat.completions", CHAT)
    await resp.aread()
    await resp.aclose()
    return resp


async def _batch_get(uplink: Uplink) -> httpx.Response:
    return await uplink.get("/v1/batches/batch_1")


def _run(pki: Path, tmp_path: Path, peer: ClosingPeer, calls: int, call: Call) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        server = await asyncio.start_server(peer.serve, "127.0.0.1", 0, ssl=server_context(pki))
        port = server.sockets[0].getsockname()[1]
        acked = AckedChunks(tmp_path / "acked.sqlite", 1000)
        uplink = Uplink(f"https://127.0.0.1:{port}", client_context(pki, "dev1"), acked, 2048, 2.0)
        try:
            return [await call(uplink) for _ in range(calls)]
        finally:
            await uplink.close()
            acked.close()
            server.close()
            await server.wait_closed()

    return asyncio.run(main())


@pytest.mark.parametrize("call", [_forward, _batch_get], ids=["edge-request", "batch-api"])
def test_a_connection_closed_as_it_is_reused_is_sent_again_on_a_fresh_one(
    pki: Path, tmp_path: Path, call: Call
) -> None:
    peer = ClosingPeer(answer_first=1)
    responses = _run(pki, tmp_path, peer, 3, call)
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert [r.content for r in responses] == [REPLY] * 3
    # each request after the first met a dead kept-alive connection and went again on a new one
    assert peer.dropped == 2
    assert peer.connections == 3
    assert peer.answered == 3


def test_a_peer_that_never_answers_is_unreachable_after_one_resend(pki: Path, tmp_path: Path) -> None:
    peer = ClosingPeer(answer_first=0)
    with pytest.raises(GatewayUnreachable, match="RemoteProtocolError"):
        _run(pki, tmp_path, peer, 1, _forward)
    assert peer.dropped == 2  # sent, sent again, then the app hears 503: no endless retrying
