"""A small OpenAI-compatible server for the fleet tests: what "any other OpenAI-compatible server"
looks like to the router. It answers chat completions (whole or streamed) with its own name, and can
be told to fail: answer 500s, or break a stream after its first event."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import uvicorn
from litestar import Litestar, Request, Response, get, post
from litestar.response import Stream

from ..conftest import MODEL


@dataclass
class Behaviour:
    name: str
    fail: bool = False  # answer 500
    break_stream: bool = False  # send one event, then drop the connection
    delay_s: float = 0.0
    seen: list[dict[str, Any]] = field(default_factory=list)  # request bodies received
    # what its /v1/models lists, so the router routes these names here (it answers any): the names
    # tests send, its own and the real model's (the batch helpers' lines name that one)
    models: tuple[str, ...] = ("stub", MODEL)


def _completion(name: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "stub",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": name}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def _chunk(content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    body = {
        "id": "chatcmpl-stub",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": "stub",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def stub_app(b: Behaviour) -> Litestar:
    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Response[bytes] | Stream:
        body = msgspec.json.decode(await request.body())
        b.seen.append(body)
        if b.delay_s:
            await asyncio.sleep(b.delay_s)
        if b.fail:
            err = {"error": {"message": "stub failure", "type": "server_error", "param": None, "code": None}}
            return Response(msgspec.json.encode(err), status_code=500, media_type="application/json")
        if not body.get("stream"):
            return Response(msgspec.json.encode(_completion(b.name)), media_type="application/json")

        async def events() -> AsyncIterator[bytes]:
            yield _chunk(b.name)
            if b.break_stream:
                raise ConnectionResetError("the stub drops the stream")
            yield _chunk(None, "stop")
            yield b"data: [DONE]\n\n"

        return Stream(events(), media_type="text/event-stream")

    @get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": 0, "owned_by": b.name} for m in b.models],
        }

    return Litestar(route_handlers=[chat, models], openapi_config=None, logging_config=None)


class StubServer:
    def __init__(self, name: str) -> None:
        self.behaviour = Behaviour(name)
        self.server = uvicorn.Server(
            uvicorn.Config(
                stub_app(self.behaviour), host="127.0.0.1", port=0, log_config=None, lifespan="off"
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=f"stub-{name}")
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the stub server did not start")
            time.sleep(0.01)
        self.port = int(self.server.servers[0].sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
