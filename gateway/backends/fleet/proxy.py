"""A request's trip through the fleet: pick a version (canary weights, or the X-Context-Version pin),
pick a backend (policy.py), send the body as the client sent it, and relay the answer.

Failover happens only before the client has received a byte: a backend that cannot be reached,
answers 5xx or 429, or breaks before its first byte, costs a retry on another backend (with a short
jittered backoff), never a failed request while another backend could take it. After the first
byte the status is sent and cannot change: a stream that breaks ends with an SSE error event, as the
gateway's own streams do (gateway/openai/sse.py), and never with a clean `[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog
from litestar import Response
from litestar.response import Stream

from gateway.access.auth import TENANT_HEADER
from gateway.backends.fleet.backend import FleetBackend
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.keys import RequestKeys
from gateway.backends.fleet.policy import Decision, choose
from gateway.backends.fleet.wire import WireError, WireResponse
from gateway.encoding import sse_event
from gateway.errors import ServiceUnavailableError
from gateway.ops import tracing
from gateway.ops.observe import annotate
from shared.disconnect import WatchedStream
from shared.errors import CtxfuseError, NotFoundError

log = structlog.get_logger("ctxfuse.fleet")

VERSION_HEADER = "x-context-version"
BACKEND_HEADER = "x-ctxfuse-backend"
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
# the backend's header -> the name the client gets it under (the router's own x-request-id stands)
_PASSED_HEADERS = {"retry-after": "retry-after", "x-request-id": "x-backend-request-id"}
_BACKOFF_S = 0.05
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Outgoing:
    path: str  # /v1/chat/completions or /v1/completions
    body: bytes  # as the client sent it
    keys: RequestKeys
    pinned: str | None  # X-Context-Version
    tenant: str | None = None  # the caller's tenant, for the worker's prefix-cache partition
    model: str | None = None  # only backends that serve it are candidates


def _candidates(fleet: Fleet, version: str | None, tried: set[str]) -> list[FleetBackend]:
    return [b for b in fleet.in_version(version) if b.name not in tried and b.takes_work()]


def _probe(fleet: Fleet, version: str | None, tried: set[str]) -> FleetBackend | None:
    """A backend whose circuit is half-open takes this request as its one probe: that is how a
    recovered backend comes back while the others carry the traffic."""
    backends = fleet.in_version(version)
    for b in fleet.rng.sample(backends, len(backends)):
        ready = b.reachable and not b.draining and b.kind is not None
        if b.name not in tried and ready and b.circuit.state == "half_open" and b.circuit.allow():
            return b
    return None


def _pick_version(fleet: Fleet, pinned: str | None) -> str | None:
    if pinned is not None:
        if pinned not in fleet.canary.versions:
            raise NotFoundError(
                f"no backend serves version {pinned!r} (known: {', '.join(fleet.canary.versions)})",
                param=VERSION_HEADER,
                code="version_not_found",
            )
        return pinned
    return fleet.canary.pick(fleet.rng)


async def forward(fleet: Fleet, out: Outgoing) -> Response[bytes] | Stream:
    return await route(fleet, out.keys, out.model, out.pinned, lambda b: _send(fleet, b, out))


async def route(
    fleet: Fleet,
    keys: RequestKeys,
    model: str | None,
    pinned: str | None,
    send: Callable[[FleetBackend], Awaitable[T | str]],
    tried: set[str] | None = None,
) -> T:
    """What `send` answers from the backend chosen for `keys`, trying another (at most
    max_attempts in all) while one answers why it failed (a str) before anything was handed on;
    `tried`: backends already tried for this request."""
    version = _pick_version(fleet, pinned)
    tried = set(tried or ())
    # a backend that serves another model is never a candidate (as if already tried)
    tried |= {b.name for b in fleet.backends if not b.serves(model)}
    if all(not b.serves(model) for b in fleet.backends):
        served = sorted({m for b in fleet.backends for m in b.models})
        if not served:  # no backend found yet (discovery), or none has said what it serves
            raise ServiceUnavailableError("no backend is available: none is known or reachable yet")
        raise NotFoundError(
            f"the model `{model}` does not exist; the fleet serves {', '.join(served)}",
            param="model",
            code="model_not_found",
        )
    last = "no backend is available"
    for attempt in range(fleet.config.max_attempts):
        if attempt:
            fleet.metrics.retries.inc()
            await asyncio.sleep(_BACKOFF_S * 2 ** (attempt - 1) * (0.5 + fleet.rng.random()))
        decision = _decide(fleet, keys, pinned, version, tried)
        if decision is None:
            break
        b = decision.backend
        tried.add(b.name)
        fleet.metrics.decisions.labels(decision=decision.kind).inc()
        annotate(backend=b.name, route_decision=decision.kind, matched_keys=decision.matched)
        # known as held from now: the same prefix arriving during this prefill (which may take
        # seconds, and no block event reports it before its end) follows it there
        fleet.remember(b, keys, decision.matched)
        block_size = b.block_size if b.reports_blocks else None
        with tracing.route_attempt(
            b.name, b.spec.version, fleet.config.policy, attempt, decision.kind, decision.matched, block_size
        ) as span:
            answer = await send(b)
            if isinstance(answer, str):
                tracing.failed(span, answer)
        if isinstance(answer, str):
            last = f"{b.name}: {answer}"
            continue
        return answer
    raise ServiceUnavailableError(f"no backend could take the request ({last})")


def _decide(
    fleet: Fleet, keys: RequestKeys, pinned: str | None, version: str | None, tried: set[str]
) -> Decision | None:
    probe = _probe(fleet, version, tried)
    if probe is not None:
        return Decision(probe, "probe", 0)
    candidates = _candidates(fleet, version, tried)
    if not candidates and pinned is None:  # the version's backends are all down: any other
        candidates = [b for b in _candidates(fleet, None, tried) if fleet.canary.weights.get(b.spec.version)]
    if not candidates:
        return None
    matched, total = fleet.match(keys, candidates)
    return choose(fleet.config.policy, candidates, matched, total, fleet.rng)


def begin(fleet: Fleet, b: FleetBackend) -> float:
    """Count a request sent to `b` (in flight until `done`); its start time."""
    fleet.metrics.requests.labels(backend=b.name, version=b.spec.version).inc()
    b.in_flight += 1
    fleet.metrics.in_flight.labels(backend=b.name).set(b.in_flight)
    return time.monotonic()


async def post(
    fleet: Fleet, b: FleetBackend, path: str, body: bytes, headers: dict[str, str], start: float
) -> WireResponse | str:
    """`b`'s answer to a POST, its body still to read, or why it failed (a str: try another). The
    current trace goes with it (`traceparent`), to a worker or any other server."""
    tracing.inject(headers)
    credential = fleet.credential(b)
    if credential is not None:
        headers["authorization"] = credential
    try:
        resp = await fleet.wire.post(f"{b.url}{path}", body, headers)
    except WireError as exc:
        return failed(fleet, b, "connect" if exc.kind == "connect" else "transport", exc, start)
    if resp.status_code in RETRY_STATUSES:
        await resp.aclose()
        return failed(fleet, b, "status", f"answered {resp.status_code}", start)
    return resp


async def _send(fleet: Fleet, b: FleetBackend, out: Outgoing) -> Response[bytes] | Stream | str:
    """The answer to relay, or why this backend failed before any byte reached the client."""
    start = begin(fleet, b)
    handed_over = False
    try:
        headers = {"content-type": "application/json"}
        if out.tenant is not None:
            headers[TENANT_HEADER] = out.tenant
        resp = await post(fleet, b, out.path, out.body, headers, start)
        if isinstance(resp, str):
            return resp
        headers = {_PASSED_HEADERS[k]: v for k, v in resp.headers.items() if k in _PASSED_HEADERS}
        headers[BACKEND_HEADER] = b.name  # which backend answered: for the client's logs and ours
        media = resp.headers.get("content-type") or "application/json"
        if not media.startswith("text/event-stream"):
            try:
                content = await resp.aread()
            except WireError as exc:
                return failed(fleet, b, "transport", exc, start)
            finally:
                await resp.aclose()
            fleet.metrics.latency.labels(backend=b.name).observe(time.monotonic() - start)
            fleet.record_outcome(b, True, time.monotonic() - start)
            return Response(content, status_code=resp.status_code, media_type=media, headers=headers)
        handed_over = True
        return WatchedStream(
            _relay(fleet, b, resp, start), status_code=resp.status_code, media_type=media, headers=headers
        )
    finally:
        if not handed_over:
            done(fleet, b)


def failed(fleet: Fleet, b: FleetBackend, kind: str, why: object, start: float) -> str:
    fleet.metrics.errors.labels(backend=b.name, kind=kind).inc()
    fleet.record_outcome(b, False, time.monotonic() - start)
    log.warning("backend_failed", backend=b.name, kind=kind, reason=str(why))
    return f"{kind}: {why}"


def done(fleet: Fleet, b: FleetBackend) -> None:
    b.in_flight -= 1
    fleet.metrics.in_flight.labels(backend=b.name).set(b.in_flight)


async def _relay(fleet: Fleet, b: FleetBackend, resp: WireResponse, start: float) -> AsyncIterator[bytes]:
    """The backend's event stream, whole events at a time (a break mid-event must not hand the client
    half an event); a break becomes an error event."""
    first = True
    ok = True
    pending = b""
    try:
        async for piece in resp.aiter_raw():
            if first:
                fleet.metrics.latency.labels(backend=b.name).observe(time.monotonic() - start)
                first = False
            pending += piece
            cut = pending.rfind(b"\n\n") + 2
            if cut >= 2:
                yield pending[:cut]
                pending = pending[cut:]
        if pending:
            yield pending
    except WireError as exc:
        ok = False
        fleet.metrics.errors.labels(backend=b.name, kind="stream").inc()
        log.warning("stream_broken", backend=b.name, reason=str(exc))
        why = f"the backend {b.name} failed mid-stream ({type(exc).__name__}); retry the request"
        yield sse_event(CtxfuseError(why).to_openai())
    finally:
        await resp.aclose()
        done(fleet, b)
        fleet.record_outcome(b, ok, time.monotonic() - start)
