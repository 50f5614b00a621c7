"""HTTP/1.1 by hand, for what no client library will do on purpose: send an oversized or unfinished
request head, hold a connection silent, reuse one exact connection across requests and see the
server close it."""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

# hang guard for every read: a test that fails waits this long at most; never a measured time
GUARD_S = 30.0


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=GUARD_S)


def request_head(path: str = "/health", extra: bytes = b"") -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + extra + b"\r\n"


def exchange(sock: socket.socket, head: bytes) -> Answer:
    """Send one request head on `sock` and read its whole response; the connection stays usable."""
    sock.sendall(head)
    return read_answer(sock)


def read_answer(sock: socket.socket) -> Answer:
    resp = http.client.HTTPResponse(sock)  # reads through its own file object, to the body's end
    resp.begin()
    body = resp.read()
    headers = {k.lower(): v for k, v in resp.getheaders()}
    return Answer(resp.status, headers, body)


def closed_by_server(sock: socket.socket) -> bool:
    """Read until the server closes: True on EOF (or a reset), False if it sent bytes instead.
    A connection still open after GUARD_S fails the test by timing out."""
    try:
        data = sock.recv(1)
    except ConnectionResetError:
        return True
    return data == b""


def drip_until_closed(sock: socket.socket, head: bytes, interval_s: float = 0.1) -> bool:
    """Send `head` one byte at a time, every `interval_s`, watching for the server to close; True if
    it closed before the head was complete. Bounded by GUARD_S (a hang guard)."""
    sock.settimeout(interval_s)
    deadline = time.monotonic() + GUARD_S
    try:
        for i in range(len(head)):
            if time.monotonic() > deadline:
                return False
            try:
                # EOF: closed; any bytes: an answer to an unfinished head, not what a drip should get
                return sock.recv(1) == b""
            except TimeoutError:
                pass
            sock.sendall(head[i : i + 1])
    except (ConnectionResetError, BrokenPipeError):
        return True
    finally:
        sock.settimeout(GUARD_S)
    return False


def get_raw_path(base: str, path: str) -> tuple[int, bytes]:
    """GET `path` exactly as written (http.client neither decodes nor normalizes it)."""
    where = urlsplit(base)
    conn = http.client.HTTPConnection(where.hostname or "", where.port, timeout=GUARD_S)
    try:
        conn.putrequest("GET", path, skip_accept_encoding=True)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()
