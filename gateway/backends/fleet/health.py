"""Active health checks, and the block events of ctxfuse workers: one task per gateway that asks
every backend every `health_interval_s`.

- A ctxfuse worker answers `GET /internal/v1/state` (its load, whether it drains, its epoch) and
  `GET /internal/v1/blocks` (prefix-cache events since our cursor). A new epoch means the worker
  restarted: everything the index held for it is dropped before its new events are read.
- Any other server is asked `GET /v1/models`.
- `kind = "auto"` is settled by the first answer: a state route means ctxfuse, a 404 there means a
  plain OpenAI-compatible server.

A check that gets no answer (or a 5xx) trips the backend's circuit at once (and again each time,
so its cool-down runs from the last failed check). A check that succeeds does not close a circuit:
once the cool-down has passed, the next request is the probe that does (and /ready counts the
backend, so a router whose workers came up after it is ready for that request).

A router given no model file takes the tokenizer and chat template from the first ctxfuse worker
that answers (`GET /internal/v1/text-side`); until one has, it is not ready. A fleet of other
servers alone counts tokens with the default model's.
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import structlog

from cloud.model.text_side import load_text_side, text_side_from
from gateway.backends.fleet.backend import FleetBackend
from gateway.backends.fleet.discovery import Discovery
from gateway.backends.fleet.fleet import Fleet
from shared.errors import ModelLoadError
from shared.fleet_protocol import HASH_SCHEME, BlockEvents, TextSide, WorkerState
from shared.heap import release_free_heap

log = structlog.get_logger("ctxfuse.fleet")

CHECK_TIMEOUT_S = 2.0


class Unhealthy(Exception):
    pass


async def _get(fleet: Fleet, b: FleetBackend, path: str, **params: str | int) -> httpx.Response:
    try:
        resp = await fleet.client.get(f"{b.url}{path}", params=params, timeout=CHECK_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise Unhealthy(f"{type(exc).__name__}: {exc}") from None
    if resp.status_code >= 500:
        raise Unhealthy(f"{path} answered {resp.status_code}")
    return resp


async def _check_worker(fleet: Fleet, b: FleetBackend) -> bool:
    """True if `b` is a ctxfuse worker (state read, events applied); False if it has no state route."""
    resp = await _get(fleet, b, "/internal/v1/state")
    if resp.status_code == 404:
        return False
    try:
        state = msgspec.json.decode(resp.content, type=WorkerState)
    except msgspec.DecodeError as exc:
        raise Unhealthy(f"state is not readable: {exc}") from None
    b.reported, b.draining = state.load, state.draining
    b.models = [state.model]
    b.max_model_len = state.max_model_len or b.max_model_len
    if state.hash_scheme != HASH_SCHEME:  # another hash: its blocks cannot be matched, only balanced
        b.block_size = None
        return True
    b.block_size = state.block_size
    if state.epoch != b.epoch:
        if b.epoch is not None:
            log.info("worker_restarted", backend=b.name, epoch=state.epoch)
        fleet.index.forget(b.name)
        b.epoch, b.next_event = state.epoch, 0
    if fleet.text_side is None:  # what the router plans with (and names blocks with, given no model)
        await _adopt_text_side(fleet, b)
    await _read_events(fleet, b, state.epoch)
    return True


async def _adopt_text_side(fleet: Fleet, b: FleetBackend) -> None:
    resp = await _get(fleet, b, "/internal/v1/text-side")
    if resp.status_code != 200:  # a worker older than the route: another may have it
        return
    try:
        side = msgspec.msgpack.decode(resp.content, type=TextSide)
        tokenizer, template = await asyncio.to_thread(text_side_from, side)  # ~0.1 s for a vocabulary
        release_free_heap()  # ~25 MiB the tokenizer's parse freed, kept as RSS otherwise
    except (msgspec.DecodeError, msgspec.ValidationError, ModelLoadError) as exc:
        log.warning("text_side_unreadable", backend=b.name, reason=str(exc))
        return
    if fleet.text_side is None:
        fleet.adopt_text_side(tokenizer, template, side)
        log.info("text_side_adopted", backend=b.name, model=side.model)


async def _read_events(fleet: Fleet, b: FleetBackend, epoch: str) -> None:
    resp = await _get(fleet, b, "/internal/v1/blocks", epoch=epoch, since=b.next_event)
    try:
        events = msgspec.msgpack.decode(resp.content, type=BlockEvents)
    except msgspec.DecodeError as exc:
        raise Unhealthy(f"block events are not readable: {exc}") from None
    if events.reset or events.epoch != b.epoch:
        fleet.index.forget(b.name)
        b.epoch = events.epoch
    fleet.index.remove(b.name, events.evicted)
    fleet.index.add(b.name, events.stored)
    b.next_event = events.next_event
    fleet.metrics.index_keys.set(len(fleet.index))


async def check(fleet: Fleet, b: FleetBackend) -> None:
    try:
        if b.kind in (None, "ctxfuse") and await _check_worker(fleet, b):
            b.kind = "ctxfuse"
        else:
            resp = await _get(fleet, b, "/v1/models")
            if resp.status_code != 200:
                raise Unhealthy(f"/v1/models answered {resp.status_code}")
            listed = _listed(resp.content)
            if listed is not None:
                b.models = [m.id for m in listed.data if m.id]
                b.max_model_len = (listed.data[0].max_model_len if listed.data else None) or b.max_model_len
            b.kind = b.kind or "openai"
    except Unhealthy as exc:
        if b.reachable:
            log.warning("backend_unhealthy", backend=b.name, reason=str(exc))
        b.reachable = False
        b.circuit.trip(f"health check: {exc}")
        return
    if not b.reachable:
        log.info("backend_reachable", backend=b.name)
    b.reachable = True


class _Listed(msgspec.Struct):
    id: str = ""
    max_model_len: int | None = None  # vLLM's and ours; other servers leave it out


class _ModelList(msgspec.Struct):
    data: list[_Listed] = msgspec.field(default_factory=list)


def _listed(content: bytes) -> _ModelList | None:
    """A server's model list: the names it serves and, where it says, their context."""
    try:
        return msgspec.json.decode(content, type=_ModelList)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


async def check_all(fleet: Fleet) -> None:
    """Every backend once, at the same time."""
    await asyncio.gather(*(check(fleet, b) for b in fleet.backends))
    if fleet.keys is None and fleet.backends and all(b.kind == "openai" for b in fleet.backends):
        # no ctxfuse worker will send its text side: the default model's counts tokens instead
        fleet.adopt_text_side(*await asyncio.to_thread(load_text_side, None))


async def run_checks(fleet: Fleet) -> None:
    """Forever, every health_interval_s: all backends at once; with [discovery], the backends its
    name resolves to are added and dropped alongside (discovery.py), each checked once it comes."""
    found = None
    if fleet.config.discovery is not None:
        discovery = Discovery(fleet, fleet.config.discovery)

        async def check_new(backends: list[FleetBackend]) -> None:
            await asyncio.gather(*(check(fleet, b) for b in backends))

        found = asyncio.create_task(discovery.run(check_new), name="fleet-discovery")
    try:
        while True:
            await check_all(fleet)
            await asyncio.sleep(fleet.config.health_interval_s)
    finally:
        if found is not None:
            found.cancel()
            await asyncio.gather(found, return_exceptions=True)
