"""A loopback backend that speaks the raw bytes each test writes, for the tests of the fleet router's
HTTP/1.1 client (gateway/backends/fleet/wire.py): test_wire.py (answers, connections kept and not)
and test_wire_failures.py (every failure as its WireError kind, back-pressure, bodies framed by the
connection's end, heads that never end)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, ParamSpec

from gateway.backends.fleet.wire import WireClient

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
