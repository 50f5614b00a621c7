"""The router's HTTP/1.1 client for the work it sends on (relayed chat and completions, the engine
seam's generate and embed): kept-alive connections per backend on asyncio protocols, responses parsed
by httptools (llhttp, the parser uvicorn uses). httpx spent most of the router's time per request on
this path (its pool, anyio and h11 layers: ~1 ms of a 1.35 ms added p50 before an instant upstream,
docs/benchmarks.md); the health checks and other rare calls still use it.

- A request goes out in one write (head and body); the answer's body is handed on as it arrives,
  de-chunked, never decompressed (nothing asks for an encoding).
- A connection goes back to its pool only when its answer was read to the end and the backend keeps
  it alive; an answer closed early closes the connection, which is how a backend learns that the
  client left (it aborts the request). Idle connections are dropped after `keep_alive_s`, shorter
  than any server keeps them (shared/keep_alive.py), so a request never races a server's idle close.
- A reader that falls behind stops the socket's reading (at `_HIGH_WATER` bytes held), so a slow
  client never makes the router hold a fast backend's whole answer.
- Errors are `WireError`s: `connect` (the backend was never reached: safe to send elsewhere),
  `timeout` (nothing arrived for `read_timeout_s`) or `transport` (a broken or unreadable answer).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Literal, cast
from urllib.parse import urlsplit

import httptools

MAX_HEADER_BYTES = 64 * 1024  # a backend's answer head; more is a broken backend, not an answer
_HIGH_WATER = 1 << 20
_MAX_IDLE = 256  # idle connections kept per backend

Kind = Literal["connect", "timeout", "transport"]


class WireError(Exception):
    def __init__(self, kind: Kind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Headers:
    """An answer's headers: names lower-cased, in order, repeats kept."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        self._items: list[tuple[str, str]] = []

    def get(self, name: str, default: str | None = None) -> str | None:
        name = name.lower()
        return next((v for k, v in self._items if k == name), default)

    def items(self) -> list[tuple[str, str]]:
        return list(self._items)


class WireResponse:
    """A backend's answer: status and headers read, the body still arriving."""

    def __init__(self, conn: _Connection) -> None:
        self.status_code = 0
        self.headers = Headers()
        self.content = b""  # the whole body, once aread() has read it
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._complete = False
        self._error: WireError | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- fed by the connection -----------------------------------------------------------------

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _push(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: WireError) -> None:
        if not self._complete and self._error is None:
            self._error = error
            self._wake()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- read by the caller --------------------------------------------------------------------

    async def _headers(self) -> None:
        while not self.status_code:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (what has arrived since the last piece, joined)."""
        while True:
            if self._chunks:
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks.clear()
                self._buffered = 0
                self._conn.resume()
                yield data
            elif self._complete:
                return
            elif self._error is not None:
                raise self._error
            else:
                await self._wait()

    async def aread(self) -> bytes:
        self.content = b"".join([piece async for piece in self.aiter_raw()])
        return self.content

    async def aclose(self) -> None:
        self._conn.release(self)


class _Connection(asyncio.Protocol):
    def __init__(self, client: WireClient, key: tuple[str, str, int]) -> None:
        self.client = client
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.response: WireResponse | None = None
        self.lost = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._loop = asyncio.get_running_loop()
        self._keep_alive = False
        self._until_eof = False  # neither a length nor chunks: the body ends when the connection does
        self._interim = False  # a 1xx answer: the real one follows
        self._header_bytes = 0  # what arrived before the head was whole (a line may never end)
        self._line_bytes = 0  # the head's finished lines, when one read holds several answers' heads
        self._last_read = 0.0
        self._watchdog: asyncio.TimerHandle | None = None
        self._paused = False

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        r = self.response
        if r is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(f"the backend's answer is not valid HTTP ({exc})")
            return
        if not r.status_code:  # still in the head: a line that never ends is bounded here (the
            self._header_bytes += len(data)  # raw head also holds the status line and line ends)
            if self._header_bytes > 2 * MAX_HEADER_BYTES:
                self._broken(f"the answer's head passes {MAX_HEADER_BYTES} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._disarm()
        r = self.response
        if r is None or r._complete or r._error is not None:
            return
        if r.status_code and self._until_eof and exc is None:  # a body framed by the connection's end
            r._finish()
        else:
            why = f": {exc}" if exc else ""
            r._fail(WireError("transport", f"the backend closed the connection before its answer ended{why}"))

    # -- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        r = self.response
        if r is not None and r._complete:  # more after the whole answer: nothing we asked for
            self._keep_alive = False
            raise ValueError("the backend sent more than its answer")
        if r is not None:
            r.headers = Headers()  # after a 1xx answer
        self._line_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._line_bytes += len(name) + len(value)
        if self._line_bytes > MAX_HEADER_BYTES:
            raise ValueError(f"the answer's headers pass {MAX_HEADER_BYTES} bytes")
        assert self.response is not None
        self.response.headers._items.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        r = self.response
        assert r is not None
        status = self._parser.get_status_code()
        self._interim = status < 200
        if self._interim:
            return
        self._keep_alive = self._parser.should_keep_alive()
        chunked = "chunked" in (r.headers.get("transfer-encoding") or "").lower()
        self._until_eof = not chunked and r.headers.get("content-length") is None
        r.status_code = status
        r._wake()

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response._push(body)

    def on_message_complete(self) -> None:
        if self._interim:
            return
        self._disarm()
        assert self.response is not None
        self.response._finish()

    # -- used by the client and the response ---------------------------------------------------

    def send(self, head: bytes, body: bytes, read_timeout_s: float) -> WireResponse:
        assert self.transport is not None
        self.response = r = WireResponse(self)
        self._header_bytes = 0
        self._last_read = self._loop.time()
        self._watchdog = self._loop.call_later(read_timeout_s, self._check_timeout, read_timeout_s)
        self.transport.writelines((head, body))
        return r

    def _check_timeout(self, timeout_s: float) -> None:
        if self._paused:  # our reader is behind, not the backend: quiet from here on counts
            self._last_read = self._loop.time()
        quiet = self._loop.time() - self._last_read
        if quiet < timeout_s:
            self._watchdog = self._loop.call_later(timeout_s - quiet, self._check_timeout, timeout_s)
            return
        self._watchdog = None
        if self.response is not None:
            self.response._fail(WireError("timeout", f"the backend sent nothing for {timeout_s:g} s"))
        self.close()

    def _disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _broken(self, why: str) -> None:
        if self.response is not None:
            self.response._fail(WireError("transport", why))
        self.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.lost:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.lost:
            self._paused = False
            self.transport.resume_reading()

    def release(self, r: WireResponse) -> None:
        if r is not self.response:
            return
        if r._complete and self._keep_alive and not self.lost and not self.client.closed:
            self.response = None
            self._disarm()
            self.resume()
            self.client._give_back(self)
        else:
            self.close()

    def close(self) -> None:
        self._disarm()
        if self.transport is not None:
            self.transport.close()
        self.lost = True


@lru_cache(maxsize=1024)
def _endpoint(url: str) -> tuple[tuple[str, str, int], str, bytes]:
    """(pool key, request target, Host header) of an absolute URL."""
    parts = urlsplit(url)
    scheme, host = parts.scheme, parts.hostname
    if scheme not in ("http", "https") or not host:
        raise WireError("connect", f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    authority = parts.netloc.rpartition("@")[2]  # credentials in a URL never go into Host
    return (scheme, host, port), target, authority.encode("ascii")


def _head(target: str, host: bytes, length: int, headers: dict[str, str]) -> bytes:
    lines = [f"POST {target} HTTP/1.1".encode(), b"host: " + host, f"content-length: {length}".encode()]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise ValueError(f"header {name!r} cannot be sent as given")
        lines.append(f"{name}: {value}".encode("latin-1"))
    lines.append(b"\r\n")
    return b"\r\n".join(lines)


class WireClient:
    def __init__(self, connect_timeout_s: float, read_timeout_s: float, keep_alive_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keep_alive_s = keep_alive_s
        self.closed = False
        self._idle: dict[tuple[str, str, int], deque[_Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> WireResponse:
        """The answer to a POST once its status and headers arrived; WireError if it failed before.
        A caller cancelled while waiting closes the connection (the backend aborts the request)."""
        key, target, host = _endpoint(url)
        head = _head(target, host, len(body), headers)
        conn = self._take(key) or await self._connect(key)
        r = conn.send(head, body, self.read_timeout_s)
        try:
            await r._headers()
        except BaseException:
            conn.close()
            raise
        return r

    def _take(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if not conn.lost and now - conn.idle_since < self.keep_alive_s:
                return conn
            conn.close()
        return None

    def _give_back(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.key, deque())
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)
        while len(idle) > _MAX_IDLE or (idle and conn.idle_since - idle[0].idle_since >= self.keep_alive_s):
            idle.popleft().close()

    async def _connect(self, key: tuple[str, str, int]) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if scheme == "https" else None
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, key), host, port, ssl=tls),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError) as exc:
            why = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
            raise WireError("connect", f"cannot connect to {host}:{port}: {why}") from None
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            import certifi  # httpx's own CA bundle, so a backend trusted before is trusted now

            self._tls = ssl.create_default_context(cafile=certifi.where())
        return self._tls

    def close(self) -> None:
        self.closed = True
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
