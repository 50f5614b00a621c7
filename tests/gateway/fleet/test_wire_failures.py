"""The fleet router's HTTP/1.1 client (gateway/backends/fleet/wire.py) when its backend misbehaves
(wire_rig.py's raw-bytes servers): every failure as its WireError kind (nothing listening, a close
before the answer, a body cut short, silence before the head or mid-body, an answer that is not HTTP,
a head over the limit, headers that cannot be sent); back-pressure on a fast backend; bodies framed by
the connection's end that stall or are reset, and header lines that never end."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable

import pytest

from gateway.backends.fleet.wire import _HIGH_WATER, MAX_HEADER_BYTES, WireError, WireResponse

from .wire_rig import (
    Backend,
    Peer,
    Request,
    answer,
    on_loop,
    read_all,
    replies,
    wire,
)

# -- failures ------------------------------------------------------------------------------------


async def failure(r: Awaitable[object]) -> WireError:
    with pytest.raises(WireError) as caught:
        await r
    return caught.value


@on_loop
async def test_nothing_listening_is_a_connect_error() -> None:
    with socket.socket() as taken, wire() as client:
        taken.bind(("127.0.0.1", 0))  # bound, never listening: a connection to it is refused
        port = taken.getsockname()[1]
        error = await failure(client.post(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}", {}))
    assert error.kind == "connect"


@on_loop
async def test_a_backend_that_closes_without_answering_is_a_transport_error() -> None:
    async def hang_up(peer: Peer) -> None:
        await peer.request()

    async with Backend(hang_up) as backend:
        with wire() as client:
            error = await failure(client.post(backend.url + "/v1/chat/completions", b"{}", {}))
    assert error.kind == "transport"


@on_loop
async def test_a_body_cut_short_by_the_backend_is_a_transport_error_while_reading() -> None:
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789"
    async with Backend(replies(cut, then_close=True)) as backend:
        with wire() as client:
            r = await client.post(backend.url + "/v1/chat/completions", b"{}", {})
            assert r.status_code == 200
            error = await failure(r.aread())
            await r.aclose()
    assert error.kind == "transport"


@on_loop
async def test_a_backend_silent_before_its_headers_is_a_timeout_and_its_connection_closed() -> None:
    async def silent(peer: Peer) -> None:
        await peer.request()
        await peer.until_hung_up()

    async with Backend(silent) as backend:
        with wire(read_timeout_s=0.2) as client:
            error = await failure(client.post(backend.url + "/v1/chat/completions", b"{}", {}))
            await backend.peers[0].hung_up.wait()
    assert error.kind == "timeout"


@on_loop
async def test_a_backend_silent_mid_body_is_a_timeout_while_reading() -> None:
    async def stalls(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
        await peer.until_hung_up()

    async with Backend(stalls) as backend:
        with wire(read_timeout_s=0.2) as client:
            r = await client.post(backend.url + "/v1/chat/completions", b"{}", {})
            error = await failure(r.aread())
            await r.aclose()
            await backend.peers[0].hung_up.wait()
    assert error.kind == "timeout"


@pytest.mark.parametrize(
    "garbage",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: ten\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    ],
    ids=["not-http", "bad-length", "bad-header"],
)
@on_loop
async def test_an_answer_that_is_not_http_is_a_transport_error(garbage: bytes) -> None:
    async with Backend(replies(garbage)) as backend:
        with wire() as client:
            error = await failure(client.post(backend.url + "/v1/chat/completions", b"{}", {}))
    assert error.kind == "transport"


def padded_head(header_bytes: int) -> bytes:
    """An answer whose header names and values come to `header_bytes`, in 1 KiB headers."""
    lines = []
    for i in range(header_bytes // 1024):
        name = b"x-pad-%04d" % i
        lines.append(name + b": " + b"a" * (1024 - len(name)) + b"\r\n")
    return b"HTTP/1.1 200 OK\r\n" + b"".join(lines) + b"content-length: 2\r\n\r\nok"


@on_loop
async def test_an_answer_head_within_the_header_limit_is_read() -> None:
    async with Backend(replies(padded_head(MAX_HEADER_BYTES - 1024))) as backend:
        with wire() as client:
            assert await read_all(client, backend.url) == b"ok"


@pytest.mark.parametrize(
    "head",
    [
        padded_head(MAX_HEADER_BYTES + 4096),
        b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (MAX_HEADER_BYTES + 1) + b"\r\ncontent-length: 2\r\n\r\nok",
    ],
    ids=["many-headers", "one-long-header"],
)
@on_loop
async def test_an_answer_head_over_the_header_limit_is_a_transport_error(head: bytes) -> None:
    async with Backend(replies(head)) as backend:
        with wire() as client:
            error = await failure(client.post(backend.url + "/v1/chat/completions", b"{}", {}))
    assert error.kind == "transport"


@pytest.mark.parametrize(
    "headers",
    [
        {"x-a": "1\r\nx-injected: 1"},
        {"x-a": "1\nx-injected: 1"},
        {"x-a": "1\rx-injected: 1"},
        {"x-a\r\nx-injected": "1"},
        {"x-a: 1\r\nx-b": "2"},
    ],
    ids=["crlf-value", "lf-value", "cr-value", "crlf-name", "colon-name"],
)
@on_loop
async def test_a_header_with_cr_or_lf_is_refused_before_anything_is_sent(headers: dict[str, str]) -> None:
    async with Backend(replies(answer(b"ok"))) as backend:
        with wire() as client:
            with pytest.raises(ValueError):
                await client.post(backend.url + "/v1/chat/completions", b"bad", headers)
            assert await read_all(client, backend.url, b"good") == b"ok"
    assert backend.accepted == 1
    assert [seen.body for seen in backend.requests] == [b"good"]  # the refused one never went out


# -- back-pressure -------------------------------------------------------------------------------

_PIECE = 1 << 16
_FAST_TOTAL = 32 << 20  # far more than loopback's socket buffers hold (a few MiB, both sides together)
_READ_MAX = 256 * 1024  # the most asyncio's socket transport reads at once: one read past the mark


def _piece(i: int) -> bytes:
    return i.to_bytes(4, "big") * (_PIECE // 4)  # every piece different: a lost or swapped one shows


@on_loop
async def test_a_reader_that_falls_behind_stops_a_fast_backend_and_still_gets_every_byte() -> None:
    written = 0

    async def fast(peer: Peer) -> None:
        nonlocal written
        await peer.request()
        peer.writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % _FAST_TOTAL)
        for i in range(_FAST_TOTAL // _PIECE):
            peer.writer.write(_piece(i))
            await peer.writer.drain()
            written += _PIECE
        await peer.until_hung_up()

    async with Backend(fast) as backend:
        with wire() as client:
            r = await client.post(backend.url + "/v1/chat/completions", b"{}", {})
            seen = -1
            while written != seen:  # until the backend's writes block
                seen = written
                await asyncio.sleep(0.05)
            assert written < _FAST_TOTAL // 2
            assert held(r) <= _HIGH_WATER + _READ_MAX
            body = await r.aread()
            await r.aclose()
    assert body == b"".join(_piece(i) for i in range(_FAST_TOTAL // _PIECE))


def held(r: WireResponse) -> int:
    """Bytes the client holds for the answer, not yet read by its caller."""
    return sum(len(c) for c in r._chunks)


# -- bodies framed by the connection's end, and heads that never end -------------------------------


@on_loop
async def test_a_body_framed_by_the_connection_that_stalls_is_a_timeout_not_an_end() -> None:
    async def stalls(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npart")
        await peer.until_hung_up()

    async with Backend(stalls) as backend:
        with wire(read_timeout_s=0.2) as client:
            r = await client.post(backend.url + "/v1/chat/completions", b"{}", {})
            pieces = r.aiter_raw()
            assert await anext(pieces) == b"part"
            await asyncio.sleep(0.4)  # the caller is busy (relaying the piece) when the timeout fires
            error = await failure(anext(pieces))
            await r.aclose()
    assert error.kind == "timeout"


@on_loop
async def test_a_body_framed_by_the_connection_cut_by_a_reset_is_a_transport_error() -> None:
    async def resets(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npart")
        await peer.writer.drain()
        await asyncio.sleep(0.02)
        sock = peer.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close by RST
        peer.writer.transport.abort()

    async with Backend(resets) as backend:
        with wire() as client:
            r = await client.post(backend.url + "/v1/chat/completions", b"{}", {})
            error = await failure(r.aread())
            await r.aclose()
    assert error.kind == "transport"


@on_loop
async def test_a_header_line_that_never_ends_is_a_transport_error_not_held_in_memory() -> None:
    async def endless(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(b"HTTP/1.1 200 OK\r\nx-big: ")
        for _ in range(16):  # 1 MiB of one header's value, and never its end
            peer.writer.write(b"a" * _PIECE)
            await peer.writer.drain()
        await peer.until_hung_up()

    async with Backend(endless) as backend:
        with wire(read_timeout_s=0.5) as client:
            error = await failure(client.post(backend.url + "/v1/chat/completions", b"{}", {}))
    assert error.kind == "transport"


@on_loop
async def test_a_reader_slower_than_the_read_timeout_is_not_a_backend_timeout() -> None:
    """The socket paused for our own slow reader is no silence of the backend's."""
    total = 8 << 20

    async def fast(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for i in range(total // _PIECE):
            peer.writer.write(_piece(i))
            await peer.writer.drain()
        await peer.until_hung_up()

    async with Backend(fast) as backend:
        with wire(read_timeout_s=0.2) as client:
            r = await client.post(backend.url + "/v1/chat/completions", b"{}", {})
            await asyncio.sleep(0.5)  # the caller busy elsewhere for longer than the read timeout
            body = await r.aread()
            await r.aclose()
    assert len(body) == total


@on_loop
async def test_credentials_in_a_backend_url_never_reach_the_host_header() -> None:
    seen: list[Request] = []

    async def record(peer: Peer) -> None:
        req = await peer.request()
        assert req is not None
        seen.append(req)
        peer.writer.write(answer())
        await peer.until_hung_up()

    async with Backend(record) as backend:
        url = backend.url.replace("http://", "http://user:secret@")
        with wire() as client:
            assert await read_all(client, url) == b"ok"
    assert seen[0].header("host") == backend.url.removeprefix("http://")
