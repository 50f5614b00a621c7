"""The edge listener's routes (mutual TLS only): OpenAI requests arriving over the edge link, with
their long strings as chunk references, served exactly as the plain routes serve them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from litestar import Request, post

from gateway.access.auth import principal_of
from gateway.edge.budget import ExpansionBudget, check_ref_count
from gateway.edge.link import expand, store_new_chunks
from gateway.edge.stores import AnyChunkStore
from gateway.errors import ServiceUnavailableError
from gateway.openai.routes import answer, gateway_of
from gateway.ops.metrics import Metrics
from gateway.ops.observe import annotate
from gateway.upstream import CHAT_PATH, COMPLETIONS_PATH, Answered
from shared.edge_protocol import EdgeRequest
from shared.errors import InvalidRequestError

AnyRequest = Request[Any, Any, Any]
_PATHS = {"chat.completions": CHAT_PATH, "completions": COMPLETIONS_PATH}


def device_of(request: AnyRequest) -> str | None:
    """The device name from the client certificate (set by shared.tls.DeviceScope)."""
    name = request.scope.get("state", {}).get("device")
    return name if isinstance(name, str) else None


@post("/edge/v1/request", status_code=200, summary="An OpenAI request over the edge link (msgpack)")
async def edge_request(request: AnyRequest) -> Answered:
    arrival = time.monotonic()
    gw = gateway_of(request)
    store = gw.chunk_store
    if store is None:
        raise ServiceUnavailableError("this gateway keeps no chunk store")
    endpoint, body = await receive_edge_request(request, store, gw.metrics)
    return await answer(request, _PATHS[endpoint], body, arrival)


async def receive_edge_request(
    request: AnyRequest, store: AnyChunkStore, metrics: Metrics
) -> tuple[str, bytes]:
    """(the endpoint, the OpenAI JSON body with the device's strings put back). The request's new
    chunks are stored before anything but its size can refuse it, so a retry after a 409 sends only
    the rest. Chunks are stored and looked up as the caller's tenant's. Expanded, it is held to the
    body limit of this listener, the same as the OpenAI port's (both are GatewayConfig.max_body_bytes)."""
    raw = await request.body()
    limit = request.route_handler.resolve_request_max_body_size()
    if limit is None:  # both edge apps set it; without one there is nothing to bound the expansion by
        raise ServiceUnavailableError("this edge listener has no request body limit")
    try:
        req = msgspec.msgpack.decode(raw, type=EdgeRequest)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as exc:
        raise InvalidRequestError(f"not an edge request: {exc}") from None
    device = device_of(request)
    annotate(device=device, edge_bytes=len(raw), edge_texts=len(req.texts), edge_new_chunks=len(req.chunks))
    metrics.edge_bytes.labels(device=device or "").inc(len(raw))
    # SQLite and zstd off the event loop, in one hop
    tenant = principal_of(request.state).tenant
    body = await asyncio.to_thread(store_and_expand, store, req, limit, tenant)
    annotate(edge_expanded_bytes=len(body))
    return req.endpoint, body


def store_and_expand(store: AnyChunkStore, req: EdgeRequest, limit: int, tenant: str) -> bytes:
    check_ref_count(req, limit)  # before the store is asked about any of them
    store_new_chunks(store, req, limit, tenant=tenant)
    try:
        body = msgspec.json.encode(expand(store, req, limit, tenant=tenant))
    except RecursionError:
        raise InvalidRequestError("the request body is nested too deeply", param="body") from None
    except TypeError as exc:  # msgpack allows map keys JSON has no form for (nil, true)
        raise InvalidRequestError(f"the request body is not a JSON value: {exc}", param="body") from None
    # the texts were bounded as they were put back; this bounds the JSON around them (and its escapes)
    ExpansionBudget(limit).add(len(body))
    return body


ROUTES = [edge_request]
