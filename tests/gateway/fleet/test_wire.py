"""The fleet router's HTTP/1.1 client (gateway/backends/fleet/wire.py) against loopback servers that
speak raw bytes each test writes (wire_rig.py): answers framed by length, by chunks or by the
connection's end; interim answers; kept-alive connections reused, and not reused when the answer says
close, was closed early, went idle too long or was dropped by the backend. Failures, back-pressure
and heads that never end: test_wire_failures.py."""

from __future__ import annotations

import asyncio

import pytest

from .wire_rig import (
    Backend,
    Peer,
    answer,
    chunk,
    chunked_answer,
    on_loop,
    read_all,
    replies,
    wire,
)

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
