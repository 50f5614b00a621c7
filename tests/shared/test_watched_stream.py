"""A WatchedStream (every stream the gateway, the router and the edge agent send) behind a real
uvicorn on loopback: sent whole to a reader, and closed (its `finally` run, which is what frees an
engine request or a backend connection) when the client leaves, whether the stream was waiting for
its next piece or blocked sending to a client that had stopped reading."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from litestar import Litestar, get
from litestar.params import FromQuery

from shared.conn_limits import LimitedHttpToolsProtocol
from shared.disconnect import WatchedStream

# Liveness only: how long to wait before calling the test hung. Never a speed bound.
HANG_GUARD_S = 30.0
PIECE = b"x" * 65536


@dataclass
class Probe:
    """What the streams' iterators did, recorded from the server's thread."""

    sent: int = 0
    closed: threading.Event = field(default_factory=threading.Event)


@dataclass
class Served:
    port: int
    probe: Probe
    server: uvicorn.Server


def _app(probe: Probe) -> Litestar:
    async def counted(n: int) -> AsyncIterator[bytes]:
        for i in range(n):
            yield f"data: {i}\n\n".encode()

    async def stalled() -> AsyncIterator[bytes]:
        try:
            yield b"data: first\n\n"
            await asyncio.Event().wait()  # a backend that has nothing more to say yet
        finally:
            probe.closed.set()

    async def endless() -> AsyncIterator[bytes]:
        try:
            while True:
                yield PIECE
                probe.sent += 1
        finally:
            probe.closed.set()

    @get("/counted", sync_to_thread=False)
    def counted_route(n: FromQuery[int]) -> WatchedStream:
        return WatchedStream(counted(n), media_type="text/event-stream")

    @get("/stalled", sync_to_thread=False)
    def stalled_route() -> WatchedStream:
        return WatchedStream(stalled(), media_type="text/event-stream")

    @get("/endless", sync_to_thread=False)
    def endless_route() -> WatchedStream:
        return WatchedStream(endless(), media_type="application/octet-stream")

    return Litestar([counted_route, stalled_route, endless_route])


@pytest.fixture()
def served() -> Iterator[Served]:
    probe = Probe()
    config = uvicorn.Config(
        _app(probe),
        host="127.0.0.1",
        port=0,
        http=LimitedHttpToolsProtocol,
        lifespan="off",
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield Served(port, probe, server)
    server.should_exit = True
    thread.join(HANG_GUARD_S)


def _ask(port: int, path: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """A chunked answer up to its last chunk."""
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        piece = sock.recv(65536)
        assert piece, f"the server closed before the end: {data!r}"
        data += piece
    return data


def _dechunk(body: bytes) -> bytes:
    out, rest = b"", body
    while True:
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            return out
        out, rest = out + rest[:size], rest[size + 2 :]


def test_every_piece_arrives_in_order_and_the_connection_serves_the_next_request(served: Served) -> None:
    sock = _ask(served.port, "/counted?n=50")
    try:
        head, _, body = _read_all(sock).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
        assert _dechunk(body) == b"".join(f"data: {i}\n\n".encode() for i in range(50))
        sock.sendall(b"GET /counted?n=1 HTTP/1.1\r\nHost: t\r\n\r\n")  # kept alive after a stream
        _, _, body = _read_all(sock).partition(b"\r\n\r\n")
        assert _dechunk(body) == b"data: 0\n\n"
    finally:
        sock.close()


def test_a_client_that_leaves_while_the_stream_waits_closes_the_stream(served: Served) -> None:
    sock = _ask(served.port, "/stalled")
    try:
        assert b"data: first" in sock.recv(65536)
        assert not served.probe.closed.is_set()  # still open while its client stays
    finally:
        sock.close()
    assert served.probe.closed.wait(HANG_GUARD_S), "the stream was never closed"


def test_a_client_that_stops_reading_and_leaves_closes_the_stream_blocked_sending(served: Served) -> None:
    sock = _ask(served.port, "/endless")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.recv(1024)
    # unread bytes fill the socket buffers until the server waits to send; then the client leaves
    deadline = time.monotonic() + HANG_GUARD_S
    last, steady = -1, 0
    while steady < 20:
        assert time.monotonic() < deadline, "the server never stopped sending"
        steady = steady + 1 if served.probe.sent == last else 0
        last = served.probe.sent
        time.sleep(0.01)
    assert not served.probe.closed.is_set()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
    sock.close()
    assert served.probe.closed.wait(HANG_GUARD_S), "the stream was never closed"
    # and the server still answers
    sock = _ask(served.port, "/counted?n=2")
    try:
        _, _, body = _read_all(sock).partition(b"\r\n\r\n")
        assert _dechunk(body) == b"data: 0\n\ndata: 1\n\n"
    finally:
        sock.close()
