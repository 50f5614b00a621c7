"""The internal routes of `ctxfuse worker`: what a routing gateway in front needs to know of this
engine (shared/fleet_protocol.py). Mounted only in worker mode; behind the API key like the OpenAI
routes, since a worker's prefix cache says something about its users' prompts.

- `GET /internal/v1/state`: load, draining, block size and hash scheme, the event cursor (JSON).
- `GET /internal/v1/text-side`: the model's tokenizer and chat template (msgpack), which a router
  that holds no model file reads once.
- `GET /internal/v1/blocks?epoch=E&since=N`: prefix-cache changes since event N (msgpack: a reset
  lists every held hash, tens of thousands of 16-byte values, which JSON would hex or base64).
- `POST /internal/v1/generate` and `/internal/v1/embed`: the engine seam (gateway/seam.py) over
  HTTP, for a router that planned the request itself (gateway/backends/fleet/engine.py). What
  arrives is checked again as the engine checks anything submitted; a refusal is its error status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import msgspec
from litestar import Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.params import FromQuery
from litestar.response import Stream

from cloud.engine.kv.block_events import BlockEventLog
from gateway.encoding import encode
from gateway.seam import Backend, Generation
from gateway.state import Gateway
from shared.disconnect import WatchedStream
from shared.errors import InvalidRequestError
from shared.fleet_protocol import (
    HASH_SCHEME,
    OUTPUTS_MEDIA,
    EmbedRequest,
    GenerateRequest,
    TextSide,
    WorkerLoad,
    WorkerState,
    frame,
)

MSGPACK = "application/msgpack"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class WorkerEngine:
    """What the internal routes read from the engine beyond the backend's stats."""

    block_size: int
    max_num_seqs: int
    events: BlockEventLog
    text_side: TextSide


class _WorkerUpstream(Protocol):
    backend: Backend
    worker: WorkerEngine | None


def _parts(request: Request[Any, Any, Any]) -> tuple[Gateway, Backend, WorkerEngine]:
    """The routes are mounted only over an engine upstream with a worker (backends/local.py)."""
    gw: Gateway = request.app.state.gateway
    up = cast(_WorkerUpstream, gw.upstream)
    if up.worker is None:
        raise RuntimeError("the internal routes need a worker's engine")
    return gw, up.backend, up.worker


def worker_state(gw: Gateway, backend: Backend, engine: WorkerEngine) -> WorkerState:
    stats = backend.stats()
    return WorkerState(
        model=backend.model_name,
        max_model_len=backend.max_model_len,
        epoch=engine.events.epoch,
        block_size=engine.block_size,
        hash_scheme=HASH_SCHEME,
        load=WorkerLoad(
            running=stats.num_running,
            waiting=stats.num_waiting,
            max_num_seqs=engine.max_num_seqs,
            kv_usage=stats.kv_usage,
        ),
        draining=gw.draining,
        next_event=engine.events.next_event,
    )


@get("/internal/v1/state", summary="A worker's load and prefix-cache cursor (for a routing gateway)")
async def state(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(encode(worker_state(*_parts(request))), media_type="application/json")


@get("/internal/v1/blocks", summary="Prefix-cache blocks stored and evicted since an event (msgpack)")
async def blocks(
    request: Request[Any, Any, Any], since: FromQuery[int] = 0, epoch: FromQuery[str | None] = None
) -> Response[bytes]:
    _, _, engine = _parts(request)
    return Response(msgspec.msgpack.encode(engine.events.since(epoch, since)), media_type=MSGPACK)


@get("/internal/v1/text-side", summary="The model's tokenizer and chat template (msgpack, for a router)")
async def text_side(request: Request[Any, Any, Any]) -> Response[bytes]:
    _, _, engine = _parts(request)
    return Response(msgspec.msgpack.encode(engine.text_side), media_type=MSGPACK)


def _decode(body: bytes, type_: type[T]) -> T:
    try:
        return msgspec.msgpack.decode(body, type=type_)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidRequestError(f"not a {type_.__name__} in msgpack: {exc}", code="invalid_body") from None


async def _frames(gen: Generation) -> AsyncIterator[bytes]:
    encode_output = msgspec.msgpack.Encoder().encode
    try:
        async for out in gen:
            yield frame(encode_output(out))
    finally:
        gen.close()  # the router gone (its client disconnected) aborts the request here


@post(
    "/internal/v1/generate",
    status_code=200,
    summary="Run a planned request (msgpack in, RequestOutput frames out)",
)
async def generate(request: Request[Any, Any, Any]) -> Stream:
    gw, backend, _ = _parts(request)
    gw.check_taking_work()
    req = _decode(await request.body(), GenerateRequest)
    backend.check(req.prompt_token_ids, req.params)
    gen = await backend.submit(
        req.prompt_token_ids,
        req.params,
        req.request_id,
        priority=req.priority,
        image_spans=tuple(req.image_spans),
    )
    # closing it also when the body never starts (the router gone first)
    return WatchedStream(_frames(gen), media_type=OUTPUTS_MEDIA, background=BackgroundTask(gen.close))


@post("/internal/v1/embed", status_code=200, summary="Embeddings of token ids (msgpack in, float32 rows out)")
async def embed(request: Request[Any, Any, Any]) -> Response[bytes]:
    gw, backend, _ = _parts(request)
    gw.check_taking_work()
    req = _decode(await request.body(), EmbedRequest)
    vocab = backend.tokenizer.vocab_size
    if not req.inputs or any(not ids or any(not 0 <= t < vocab for t in ids) for ids in req.inputs):
        raise InvalidRequestError("every input must be a non-empty list of token ids in the vocabulary")
    if max(len(ids) for ids in req.inputs) > backend.max_model_len:
        raise InvalidRequestError(f"an input is longer than the context ({backend.max_model_len} tokens)")
    rows = await backend.embed(req.inputs, req.pooling, req.request_id)
    return Response(rows.astype("<f4", copy=False).tobytes(), media_type="application/octet-stream")


ROUTES = [state, text_side, blocks, generate, embed]
