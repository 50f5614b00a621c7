"""An OpenAI-compatible server that answers at once, for measuring what the fleet router adds
(`ctxfuse bench gateway --fleet`): raw ASGI, like the baseline app, but a server a router can stand
before. `GET /v1/models` lists its one model; the ctxfuse worker routes (`/internal/...`) are 404, so
the router takes it for a plain OpenAI-compatible server; a POST is answered with the recorded
stream when its body asks for one (`"stream":true`, or `"stream": true`) and the recorded whole
answer otherwise. Nothing is parsed: the body is only drained and searched for that flag.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.bench.baseline import Recorded

_STREAMED = re.compile(rb'"stream"\s*:\s*true')


def _start(status: int, recorded: Recorded | None, length: int | None) -> dict[str, Any]:
    headers = [] if recorded is None else [(k.encode(), v.encode()) for k, v in recorded.headers]
    if recorded is None:
        headers.append((b"content-type", b"application/json"))
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http.response.start", "status": status, "headers": headers}


class InstantUpstream:
    def __init__(self, model: str, plain: Recorded, streamed: Recorded) -> None:
        self.plain, self.streamed = plain, streamed
        self.models = json.dumps(
            {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "bench"}]}
        ).encode()
        self._starts = {
            False: _start(200, plain, len(b"".join(plain.chunks))),
            True: _start(200, streamed, None),
        }

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        path = scope["path"]
        if scope["method"] == "GET":
            found = path == "/v1/models"
            content = self.models if found else b'{"error":{"message":"not found"}}'
            await send(_start(200 if found else 404, None, len(content)))
            await send({"type": "http.response.body", "body": content})
            return
        streamed = _STREAMED.search(body) is not None
        recorded = self.streamed if streamed else self.plain
        await send(self._starts[streamed])
        last = len(recorded.chunks) - 1
        for i, chunk in enumerate(recorded.chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < last})
