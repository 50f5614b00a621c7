"""The edge listener's routes (mutual TLS only): OpenAI requests arriving over the edge link, with
their long strings as chunk references, served exactly as the plain routes serve them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from litestar import Request, Response, post

from shared.edge_protocol import EdgeRequest
from shared.errors import InvalidRequestError

from .chunk_store import ChunkStore
from .edge_link import expand, store_new_chunks
from .errors import ServiceUnavailableError
from .metrics import Metrics
from .observe import annotate
from .openai_routes import gateway_of, serve_chat, serve_completion

AnyRequest = Request[Any, Any, Any]


def device_of(request: AnyRequest) -> str | None:
    """The device name from the client certificate (set by shared.tls.DeviceScope)."""
    name = request.scope.get("state", {}).get("device")
    return name if isinstance(name, str) else None


@post("/edge/v1/request", status_code=200, summary="An OpenAI request over the edge link (msgpack)")
async def edge_request(request: AnyRequest) -> Response[Any]:
    arrival = time.monotonic()
    gw = gateway_of(request)
    store = gw.chunk_store
    if store is None:
        raise ServiceUnavailableError("this gateway keeps no chunk store")
    endpoint, body = await receive_edge_request(request, store, gw.metrics)
    if endpoint == "chat.completions":
        return await serve_chat(request, body, arrival)
    return await serve_completion(request, body, arrival)


async def receive_edge_request(request: AnyRequest, store: ChunkStore, metrics: Metrics) -> tuple[str, bytes]:
    """(the endpoint, the OpenAI JSON body with the device's strings put back). The request's new
    chunks are stored before anything can refuse it, so a retry after a 409 sends only the rest."""
    raw = await request.body()
    try:
        req = msgspec.msgpack.decode(raw, type=EdgeRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequestError(f"not an edge request: {exc}") from None
    device = device_of(request)
    annotate(device=device, edge_bytes=len(raw), edge_texts=len(req.texts), edge_new_chunks=len(req.chunks))
    metrics.edge_bytes.labels(device=device or "").inc(len(raw))
    # SQLite and zstd off the event loop, in one hop
    return req.endpoint, await asyncio.to_thread(store_and_expand, store, req)


def store_and_expand(store: ChunkStore, req: EdgeRequest) -> bytes:
    store_new_chunks(store, req)
    return msgspec.json.encode(expand(store, req))


ROUTES = [edge_request]
