"""The fleet router's HTTP/1.1 client (gateway/backends/fleet/wire.py) against loopback servers that
speak raw bytes each test writes, so a backend can misbehave exactly as a test needs: answers framed by
length, by chunks or by the connection's end; kept-alive connections reused, and not reused when the
answer says close, was closed early, went idle too long or was dropped by the backend; every failure
as its WireError kind; interim answers; back-pressure on a fast backend; headers that cannot be sent."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import struct
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ParamSpec

import pytest

from gateway.backends.fleet.wire import _HIGH_WATER, MAX_HEADER_BYTES, WireClient, WireError, WireResponse

# hang guard for every test: a client that waits forever fails the test after this long; never a
# measured time
GUARD_S = 5.0

P = ParamSpec("P")


def on_loop(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """An async test run to its end on a fresh event loop, under the hang guard."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), GUARD_S))

    return run


# -- a backend that speaks bytes the test writes --------------------------------------------------


@dataclass(frozen=True)
class Request:
    line: str  # "POST /path?query HTTP/1.1"
    headers: list[tuple[str, str]]  # names lower-cased, in order
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)


@dataclass
class Peer:
    """One connection the backend accepted."""

    backend: Backend
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    hung_up: asyncio.Event = field(default_factory=asyncio.Event)  # the client closed it
    closed: asyncio.Event = field(default_factory=asyncio.Event)  # the backend closed it

    async def request(self) -> Request | None:
        """The next request on this connection (recorded on the backend); None once the client closed."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.hung_up.set()
            return None
        line, *fields = head[:-4].decode("latin-1").split("\r\n")
        headers = [(k.strip().lower(), v.strip()) for k, v in (f.split(":", 1) for f in fields)]
        length = int(next((v for k, v in headers if k == "content-length"), "0"))
        request = Request(line, headers, await self.reader.readexactly(length))
        self.backend.requests.append(request)
        return request

    async def until_hung_up(self) -> None:
        """Hold the connection open until the client closes it (whatever it sends is ignored)."""
        while await self.reader.read(1 << 16):
            pass
        self.hung_up.set()


Handler = Callable[[Peer], Awaitable[None]]


class Backend:
    """A loopback HTTP server whose every accepted connection runs `handler` (closed when it returns)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.peers: list[Peer] = []
        self.requests: list[Request] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def accepted(self) -> int:
        return len(self.peers)

    async def __aenter__(self) -> Backend:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer = Peer(self, reader, writer)
        self.peers.append(peer)
        try:
            await self.handler(peer)
        except (asyncio.CancelledError, ConnectionError):
            pass  # the test ended, or the client reset the connection: either way this peer is done
        finally:
            self._tasks.discard(task)
            writer.close()
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await writer.wait_closed()
        peer.closed.set()


def answer(body: bytes = b"ok", extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return b"HTTP/%s 200 OK\r\n%scontent-length: %d\r\n\r\n%s" % (version, extra, len(body), body)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def chunked_answer(*pieces: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + b"".join(chunk(p) for p in pieces) + b"0\r\n\r\n"


def replies(*answers: bytes, then_close: bool = False) -> Handler:
    """Answers the backend's n-th request (on any connection) with answers[n], the last one after that;
    the connection stays open for more unless `then_close`."""

    async def handler(peer: Peer) -> None:
        while await peer.request() is not None:
            peer.writer.write(answers[min(len(peer.backend.requests), len(answers)) - 1])
            if then_close:
                return

    return handler


def wire(read_timeout_s: float = GUARD_S, keep_alive_s: float = GUARD_S) -> contextlib.closing[WireClient]:
    return contextlib.closing(WireClient(GUARD_S, read_timeout_s, keep_alive_s))


async def read_all(client: WireClient, url: str, body: bytes = b"") -> bytes:
    """One request's whole answer, its connection handed back as the router does (aread, aclose)."""
    r = await client.post(url + "/v1/chat/completions", body, {})
    try:
        return await r.aread()
    finally:
        await r.aclose()


# -- answers read --------------------------------------------------------------------------------


@on_loop
async def test_a_length_framed_answer_gives_status_headers_and_body_and_the_request_goes_out_exactly() -> (
    None
):
    reply = (
        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nSet-Cookie: a=1\r\n"
        b"X-Trace: t1\r\nSet-Cookie: b=2\r\nContent-Length: 11\r\n\r\n"
        b'{"ok":true}'
    )
    body = b'{"messages": []}\r\n\r\n\x00\xff'  # what a head would end with, and bytes no text has
    async with Backend(replies(reply)) as backend:
        with wire() as client:
            r = await client.post(
                backend.url + "/v1/chat/completions?tenant=a&x=1",
                body,
                {"Authorization": "Bearer k", "x-ctxfuse-tenant": "t1"},
            )
            assert r.status_code == 201
            assert r.headers.get("Content-Type") == "application/json"
            assert r.headers.get("set-cookie") == "a=1"
            assert r.headers.get("x-missing") is None
            assert r.headers.items() == [
                ("content-type", "application/json"),
                ("set-cookie", "a=1"),
                ("x-trace", "t1"),
                ("set-cookie", "b=2"),
                ("content-length", "11"),
            ]
            assert await r.aread() == b'{"ok":true}'
            assert r.content == b'{"ok":true}'
            await r.aclose()
    (seen,) = backend.requests
    assert seen.line == "POST /v1/chat/completions?tenant=a&x=1 HTTP/1.1"
    assert sorted(seen.headers) == sorted(
        [
            ("host", backend.url.removeprefix("http://")),
            ("content-length", str(len(body))),
            ("authorization", "Bearer k"),
            ("x-ctxfuse-tenant", "t1"),
        ]
    )
    assert seen.body == body


@on_loop
async def test_a_chunked_answer_is_handed_on_de_chunked_piece_by_piece_as_it_arrives() -> None:
    first_seen = asyncio.Event()
    rest = [
        b"data: 2\n\n",
        b"x" * 300,
        b"data: [DONE]\n\n",
    ]  # 300 bytes: a chunk size of more than one hex digit

    async def stream(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        peer.writer.write(chunk(b"data: 1\n\n"))
        await first_seen.wait()  # nothing more until the client has the first piece
        for piece in rest:
            await asyncio.sleep(0.01)
            peer.writer.write(chunk(piece))
            await peer.writer.drain()
        await asyncio.sleep(0.01)
        peer.writer.write(b"0\r\n\r\n")
        await peer.until_hung_up()

    async with Backend(stream) as backend:
        with wire() as client:
            r = await client.post(backend.url + "/v1/chat/completions", b"{}", {})
            assert r.status_code == 200
            assert r.headers.get("content-type") == "text/event-stream"
            pieces = []
            async for piece in r.aiter_raw():
                pieces.append(piece)
                first_seen.set()
            await r.aclose()
    assert pieces[0] == b"data: 1\n\n"
    assert b"".join(pieces) == b"data: 1\n\n" + b"".join(rest)


@on_loop
async def test_a_body_that_ends_with_the_connection_is_read_whole() -> None:
    async def until_close(peer: Peer) -> None:
        await peer.request()
        peer.writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npart one, ")
        await peer.writer.drain()
        await asyncio.sleep(0.01)
        peer.writer.write(b"part two")  # and the handler's end closes the connection

    async with Backend(until_close) as backend:
        with wire() as client:
            assert await read_all(client, backend.url) == b"part one, part two"
            assert await read_all(client, backend.url) == b"part one, part two"
    assert backend.accepted == 2  # a connection that ended the answer is not reused


@pytest.mark.parametrize(
    "interim",
    [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n"],
    ids=["100", "103-with-headers"],
)
@on_loop
async def test_an_interim_answer_is_passed_over_for_the_real_one(interim: bytes) -> None:
    async def interim_first(peer: Peer) -> None:
        while await peer.request() is not None:
            peer.writer.write(interim)
            await peer.writer.drain()
            await asyncio.sleep(0.01)
            peer.writer.write(answer(b"real", extra=b"x-real: yes\r\n"))

    async with Backend(interim_first) as backend:
        with wire() as client:
            r = await client.post(backend.url + "/v1/completions", b"{}", {})
            assert r.status_code == 200
            assert r.headers.items() == [("x-real", "yes"), ("content-length", "4")]
            assert await r.aread() == b"real"
            await r.aclose()
            assert await read_all(client, backend.url) == b"real"
    assert backend.accepted == 1


# -- connections kept, and not kept --------------------------------------------------------------


@pytest.mark.parametrize(
    "reply", [answer(b"ok"), chunked_answer(b"o", b"k")], ids=["content-length", "chunked"]
)
@on_loop
async def test_sequential_requests_reuse_one_kept_alive_connection(reply: bytes) -> None:
    async with Backend(replies(reply)) as backend:
        with wire() as client:
            for i in range(3):
                assert await read_all(client, backend.url, b"%d" % i) == b"ok"
    assert backend.accepted == 1
    assert [seen.body for seen in backend.requests] == [b"0", b"1", b"2"]


@pytest.mark.parametrize(
    ("reply", "then_close"),
    [
        (answer(extra=b"connection: close\r\n"), True),
        (answer(extra=b"Connection: close\r\n"), False),  # said so, yet left open: still not reused
        (answer(version=b"1.0"), False),  # HTTP/1.0 without keep-alive
    ],
    ids=["close-and-closed", "close-but-left-open", "http-1.0"],
)
@on_loop
async def test_an_answer_that_does_not_keep_its_connection_alive_is_not_reused(
    reply: bytes, then_close: bool
) -> None:
    async with Backend(replies(reply, then_close=then_close)) as backend:
        with wire() as client:
            assert await read_all(client, backend.url, b"1") == b"ok"
            assert await read_all(client, backend.url, b"2") == b"ok"
            if not then_close:
                await backend.peers[0].hung_up.wait()  # the client closed the one it did not reuse
    assert backend.accepted == 2
    assert [seen.body for seen in backend.requests] == [b"1", b"2"]


@on_loop
async def test_an_answer_closed_before_its_end_closes_its_connection() -> None:
    half = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf!"
    async with Backend(replies(half, answer(b"ok"))) as backend:
        with wire() as client:
            r = await client.post(backend.url + "/v1/chat/completions", b"{}", {})
            assert r.status_code == 200
            await r.aclose()  # the client left: the backend must learn it
            await backend.peers[0].hung_up.wait()
            assert await read_all(client, backend.url) == b"ok"
    assert backend.accepted == 2


@on_loop
async def test_a_connection_idle_past_keep_alive_is_dropped_not_reused() -> None:
    async with Backend(replies(answer(b"ok"))) as backend:
        with wire(keep_alive_s=0.2) as client:
            assert await read_all(client, backend.url) == b"ok"
            assert await read_all(client, backend.url) == b"ok"
            assert backend.accepted == 1  # within keep_alive_s the connection is reused
            await asyncio.sleep(0.3)
            assert await read_all(client, backend.url) == b"ok"
            assert backend.accepted == 2
            await backend.peers[0].hung_up.wait()  # the expired one was closed, not leaked


@on_loop
async def test_a_connection_the_backend_closed_while_idle_is_not_reused() -> None:
    # a backend's own idle timeout: a kept-alive answer, then the connection closed
    async with Backend(replies(answer(b"ok"), then_close=True)) as backend:
        with wire() as client:
            assert await read_all(client, backend.url) == b"ok"
            await backend.peers[0].closed.wait()
            await asyncio.sleep(0.01)  # its end reaches the client's loop
            assert await read_all(client, backend.url) == b"ok"
    assert backend.accepted == 2


@pytest.mark.parametrize("while_idle", [False, True], ids=["with-the-answer", "while-idle"])
@on_loop
async def test_bytes_after_the_whole_answer_make_its_connection_untrusted(while_idle: bool) -> None:
    # a broken backend answering twice: the stale second answer must never be read as the next one's
    handed_back, stale_sent = asyncio.Event(), asyncio.Event()

    async def twice(peer: Peer) -> None:
        while await peer.request() is not None:
            if len(peer.backend.requests) > 1:
                peer.writer.write(answer(b"fresh"))
                continue
            peer.writer.write(answer(b"ok") + (b"" if while_idle else answer(b"stale")))
            if while_idle:
                await handed_back.wait()
                peer.writer.write(answer(b"stale"))
                await peer.writer.drain()
            stale_sent.set()

    async with Backend(twice) as backend:
        with wire() as client:
            assert await read_all(client, backend.url) == b"ok"
            handed_back.set()  # the connection is in the pool now
            await stale_sent.wait()
            await asyncio.sleep(0.01)  # the stale bytes reach the client's loop
            assert await read_all(client, backend.url) == b"fresh"
    assert backend.accepted == 2


@on_loop
async def test_cancelling_the_caller_while_it_waits_for_headers_closes_the_connection() -> None:
    asked = asyncio.Event()

    async def silent(peer: Peer) -> None:
        await peer.request()
        asked.set()
        await peer.until_hung_up()

    async with Backend(silent) as backend:
        with wire() as client:
            waiting = asyncio.create_task(client.post(backend.url + "/v1/chat/completions", b"{}", {}))
            await asked.wait()
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await backend.peers[0].hung_up.wait()  # the backend learns the client left


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
