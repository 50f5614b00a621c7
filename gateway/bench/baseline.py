"""The reference the gateway is measured against: a raw ASGI app that reads the request body and
answers with bytes recorded from the gateway (same headers, same body, same chunks for a stream).
Whatever the gateway takes beyond this is parsing, planning, the engine hand-off and encoding."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# uvicorn writes these itself, per response
_SERVER_HEADERS = frozenset({"date", "server", "content-length", "transfer-encoding", "connection"})


@dataclass(frozen=True, slots=True)
class Recorded:
    """One gateway response: its headers and its body as the chunks it was sent in."""

    headers: list[tuple[str, str]]
    chunks: list[bytes]

    @classmethod
    def from_response(cls, headers: list[tuple[str, str]], body: bytes, streaming: bool) -> Recorded:
        kept = [(k.lower(), v) for k, v in headers if k.lower() not in _SERVER_HEADERS]
        # an SSE stream goes out one event per chunk, each event ending in a blank line
        chunks = [e + b"\n\n" for e in body.split(b"\n\n") if e] if streaming else [body]
        return cls(kept, chunks)

    def save(self, path: Path) -> None:
        data = {"headers": self.headers, "chunks": [c.decode() for c in self.chunks]}
        path.write_text(json.dumps(data))

    @classmethod
    def load(cls, path: Path) -> Recorded:
        data = json.loads(path.read_text())
        return cls([(k, v) for k, v in data["headers"]], [c.encode() for c in data["chunks"]])


class BaselineApp:
    """Raw ASGI: drain the request body, send the recorded response."""

    def __init__(self, recorded: Recorded) -> None:
        self.chunks = recorded.chunks
        headers = [(k.encode(), v.encode()) for k, v in recorded.headers]
        if len(self.chunks) == 1:
            headers.append((b"content-length", str(len(self.chunks[0])).encode()))
        self.start = {"type": "http.response.start", "status": 200, "headers": headers}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        await send(self.start)
        last = len(self.chunks) - 1
        for i, chunk in enumerate(self.chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < last})
