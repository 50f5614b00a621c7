"""The internal routes of `ctxfuse worker`: what a routing gateway in front needs to know of this
engine (shared/fleet_protocol.py). Mounted only in worker mode; behind the API key like the OpenAI
routes, since a worker's prefix cache says something about its users' prompts.

- `GET /internal/v1/state`: load, draining, block size and hash scheme, the event cursor (JSON).
- `GET /internal/v1/text-side`: the model's tokenizer and chat template (msgpack), which a router
  that holds no model file reads once.
- `GET /internal/v1/blocks?epoch=E&since=N`: prefix-cache changes since event N (msgpack: a reset
  lists every held hash, tens of thousands of 16-byte values, which JSON would hex or base64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

import msgspec
from litestar import Request, Response, get
from litestar.params import FromQuery

from cloud.engine.kv.block_events import BlockEventLog
from gateway.encoding import encode
from gateway.seam import Backend
from gateway.state import Gateway
from shared.fleet_protocol import HASH_SCHEME, TextSide, WorkerLoad, WorkerState

MSGPACK = "application/msgpack"


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


ROUTES = [state, text_side, blocks]
