"""Connection limits for every HTTP listener of ours (the gateway's OpenAI port, its edge listener,
the fleet router, the edge agent's local port): how long a client may take to send a request head,
how big the head may be, how many connections a listener holds, and how long one connection lives.

uvicorn bounds none of this by default: its httptools protocol reads a header of any size, neither
of its protocols times out a connection that has not finished its first request head (a silent
connection, or one dripping a byte at a time, lives forever), and it has no connection cap other
than `limit_concurrency`, which counts tasks and answers 503 only once a whole head is read. So
every listener runs one of two protocols with the same bounds: a head timer, a head size bound
(431), a connection cap checked as the connection is accepted (503), and a maximum age and request
count per kept-alive connection (the last answer says `Connection: close`):
- `LimitedHttpToolsProtocol`, the default: uvicorn's httptools (llhttp, C) protocol. Per request it
  costs a fraction of h11's pure-Python parsing and framing (the router's hop is mostly this).
- `LimitedH11Protocol`: uvicorn's h11 protocol (h11 bounds the buffered head by itself), under the
  edge listener's device checks (shared/tls.py), which hook into h11's events.
Build the uvicorn options with `uvicorn_options`.

uvicorn internals this relies on (pinned `uvicorn[standard]>=0.54,<0.55`): H11Protocol's `conn`,
`connections`, `cycle`, `loop`, `handle_events`, `send_400_response` and `handle_websocket_upgrade`;
HttpToolsProtocol's parser callbacks (`on_message_begin`, `on_headers_complete`,
`on_message_complete`), `url`, `headers`, `cycle.keep_alive`, and its `data_received` answering a
parser error (a callback's exception included) through `send_400_response`; and the request cycle
closing the connection after a response to a request that asked to close.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.flow_control import CLOSE_HEADER
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# h11 answers a head that outgrows its buffer with this status (request header fields too large)
_TOO_LARGE = 431


@dataclass(frozen=True, slots=True)
class ConnLimits:
    """One listener's bounds. The defaults: nginx's for connection reuse (keepalive_requests 1000,
    keepalive_time 1 h), a head timeout that cuts a drip of one byte a second long before a 32 KiB
    head could be sent, and a connection cap below the usual 1024 open files of a process."""

    # from a new connection, or the first byte of the next request on a kept-alive one, to the end
    # of the request head; past it the connection is closed
    header_timeout_s: float = 15.0
    max_header_bytes: int = 32 * 1024  # request line and headers; larger gets a 431 and a close
    max_connections: int = 1000  # open connections on this listener; past it a 503 and a close
    max_connection_requests: int = 1000  # the response to the last one says `Connection: close`
    max_connection_age_s: float = 3600.0  # a request arriving later is answered, with a close

    def __post_init__(self) -> None:
        for name in ("header_timeout_s", "max_header_bytes", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_connection_requests <= 0 or self.max_connection_age_s <= 0:
            raise ValueError("max_connection_requests and max_connection_age_s must be positive")


def uvicorn_options(
    limits: ConnLimits,
    protocol: type[LimitedH11Protocol | LimitedHttpToolsProtocol] | None = None,
    **bind: Any,
) -> dict[str, Any]:
    """The uvicorn.Config options that put `limits` on a listener: `protocol` (by default
    LimitedHttpToolsProtocol; LimitedH11Protocol or a subclass, such as the edge listener's) bound
    to them, and to the class attributes in `bind` (uvicorn makes each connection's protocol from
    the class alone)."""
    base = protocol or LimitedHttpToolsProtocol
    bound = type(base.__name__, (base,), {"limits": limits, "__module__": base.__module__, **bind})
    return {"http": bound, "h11_max_incomplete_event_size": limits.max_header_bytes}


class _Connection(h11.Connection):
    """h11's connection, with the head's size bounded however it arrives, and remembering the status
    suggested for the last protocol error (431 for a head over the bound), which uvicorn's handler
    drops in favour of a plain 400.

    h11 bounds only a head it is still waiting on: one that arrives whole in a single read (64 KiB
    on loopback) is parsed whatever its size. So a complete head is measured too."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.error_status = 400

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.error_status = exc.error_status_hint
            raise
        if isinstance(event, h11.Request) and _head_size(event) > self.max_head_bytes:
            self.error_status = _TOO_LARGE
            raise h11.RemoteProtocolError("request head too large", error_status_hint=_TOO_LARGE)
        return event


def _head_size(request: h11.Request) -> int:
    """Bytes of the request line and headers as sent (h11 strips only optional whitespace)."""
    line = len(request.method) + len(request.target) + len(b" HTTP/1.1\r\n ")
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items()) + 2


class _Bounds(asyncio.Protocol):
    """What both limited protocols do beside their parser: the connection cap as a connection is
    accepted, the head timer, and the count and age that make a request the connection's last.
    First in their bases, so `super()` here is uvicorn's protocol."""

    limits: ClassVar[ConnLimits] = ConnLimits()
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    logger: logging.Logger
    connections: set[Any]

    def _start_clocks(self) -> None:
        self._head_timer: asyncio.TimerHandle | None = None
        self._requests = 0
        self._opened_at = self.loop.time()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        crowded = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if crowded:
            # refused before a byte is read: a full listener spends nothing on the newcomer
            self.connections.discard(self)
            self._answer_and_close(503, "server_error", "too many open connections; retry later")
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _answer_and_close(self, status: int, kind: str, message: str) -> None:
        raise NotImplementedError

    def _last_request(self) -> bool:
        old = self.loop.time() - self._opened_at >= self.limits.max_connection_age_s
        return old or self._requests >= self.limits.max_connection_requests

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        # closed without an answer, as an idle keep-alive connection is: a client that sent nothing
        # (or a slow drip) gets nothing to read, and the slot is free again
        if not self.transport.is_closing():
            self.logger.info(
                "closing a connection whose request head took over %gs", self.limits.header_timeout_s
            )
            self.transport.close()


class LimitedH11Protocol(_Bounds, H11Protocol):
    """uvicorn's h11 protocol under `limits` (set per listener by `uvicorn_options`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(self.limits.max_header_bytes)
        self._start_clocks()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        # the first byte of a request head on a kept-alive connection starts its clock
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head was read: a new request/response cycle runs
            self._cancel_head_timer()
            self._requests += 1
            if self._last_request():
                # the app's response then carries `Connection: close` and uvicorn closes after it,
                # so the client knows not to reuse the connection (no race with its next request)
                self.headers.append(CLOSE_HEADER)  # the list in the new cycle's scope

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._cancel_head_timer()  # the connection now belongs to the WebSocket protocol
        super().handle_websocket_upgrade(event)

    def send_400_response(self, msg: str) -> None:
        status = self.conn.error_status if isinstance(self.conn, _Connection) else 400
        if status == _TOO_LARGE:
            msg = f"request header fields too large (limit {self.limits.max_header_bytes} bytes)"
            self._answer_and_close(status, "invalid_request_error", msg)
        else:
            self._answer_and_close(400, "invalid_request_error", msg)

    def _answer_and_close(self, status: int, kind: str, message: str) -> None:
        """An OpenAI-shaped error, then the connection closes. h11 lets a server answer before (or
        instead of) reading a request."""
        body = _error_body(kind, message)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            CLOSE_HEADER,
        ]
        try:
            head = self.conn.send(
                h11.Response(status_code=status, headers=headers, reason=STATUS_PHRASES[status])
            )
            self.transport.write((head or b"") + body)
        except h11.LocalProtocolError:
            pass  # a response was already under way: closing is all that is left
        self.transport.close()


def _error_body(kind: str, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()


class _HeadTooLarge(Exception):
    """Raised from a parser callback: llhttp stops, and uvicorn answers through send_400_response."""


class LimitedHttpToolsProtocol(_Bounds, HttpToolsProtocol):
    """uvicorn's httptools protocol under `limits` (set per listener by `uvicorn_options`).

    The head's size: llhttp keeps no head, but httptools holds a header line's pieces until the line
    ends, so every byte fed while a head is unfinished is counted and a head still unfinished past
    the bound is answered 431 (at most one read, 64 KiB, beyond it: a pipelined head that begins
    inside a read is counted from the next); a head that does finish is measured exactly, as h11's
    is, before its request starts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._start_clocks()
        self._in_message = False  # from a request's first byte to its body's end
        self._in_head = False  # from its first byte to its head's end
        self._head_bytes = 0  # bytes fed while in a head
        self._too_large = False

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if not self._in_message:  # these bytes begin a request head
            if self._head_timer is None:
                self._arm_head_timer()
            self._in_head, self._head_bytes = True, 0
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            self._too_large = True
            self.send_400_response("")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_message = True
        if not self._in_head:  # a pipelined request, begun inside a read
            self._in_head, self._head_bytes = True, 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head_timer()
        size = len(self.parser.get_method()) + len(self.url) + len(b"  HTTP/1.1\r\n\r\n")
        size += sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            self._too_large = True
            raise _HeadTooLarge
        super().on_headers_complete()
        self._requests += 1
        if self._last_request() and self.cycle is not None:
            self.cycle.keep_alive = False  # the answer says `Connection: close`, then uvicorn closes

    def on_message_complete(self) -> None:
        self._in_message = False
        super().on_message_complete()

    def handle_websocket_upgrade(self) -> None:
        self._cancel_head_timer()  # the connection now belongs to the WebSocket protocol
        super().handle_websocket_upgrade()

    def send_400_response(self, msg: str) -> None:
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()  # a pipelined head went bad while an answer streams: no error inside it
            return
        if self._too_large:
            msg = f"request header fields too large (limit {self.limits.max_header_bytes} bytes)"
            self._answer_and_close(_TOO_LARGE, "invalid_request_error", msg)
        else:
            self._answer_and_close(400, "invalid_request_error", msg)

    def _answer_and_close(self, status: int, kind: str, message: str) -> None:
        """An OpenAI-shaped error, then the connection closes."""
        body = _error_body(kind, message)
        head = (
            f"HTTP/1.1 {status} {STATUS_PHRASES[status].decode()}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()
