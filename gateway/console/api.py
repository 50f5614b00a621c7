"""The console's data, for the server's operator only: one snapshot of what the gateway knows (its
metrics, the engine's state, the fleet's backends and canary) and the tenants' keys.

The operator is the caller holding the server's own key (`--api-key`), or anyone on a server started
open (no key at all, where /metrics is open too). A tenant's key is refused (403): tenants must not
see each other. Keys are made and revoked only on a server that has an operator's key: on an open
server the first key made would lock everyone else out, so that is refused with the reason.

The long-context benchmark's heatmaps (`ctxfuse bench longctx`, under `--bench-results`) are listed
and served by name, when present.

The snapshot carries counters, not rates: the page takes the difference between two snapshots for its
charts (tokens per second, mean time to first token over the interval, prefix-hit rate), so the
server keeps no history and two pages never disagree about one.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath
from redis.exceptions import RedisError

from gateway.access.auth import principal_of
from gateway.access.keys import ApiKey, KeyLimits, Keys
from gateway.encoding import encode
from gateway.errors import PermissionDeniedError, ServiceUnavailableError
from gateway.openai.decode import decode_body
from gateway.state import Gateway
from shared.errors import NotFoundError

JSON = "application/json"
AnyRequest = Request[Any, Any, Any]
NOT_OPERATOR = (
    "the console is for the server's operator: sign in with the server's own key (--api-key), not a "
    "tenant's key"
)
OPEN_SERVER = (
    "this server was started without --api-key, so it has no operator to manage keys: the first key "
    "made here would lock every client out. Restart it with --api-key, or use `ctxfuse keys create`"
)
# histograms are sent as their sum and count only: the page charts means over its own intervals
_HISTOGRAM_KEPT = ("_sum", "_count")
_TENANT_SAMPLES = ("ctxfuse_tenant_requests_total", "ctxfuse_tenant_tokens_total")
_HEATMAP = re.compile(r"heatmap-[A-Za-z0-9._-]+\.png")  # what `ctxfuse bench longctx` writes


def operator(request: AnyRequest, *, writes: bool = False) -> Gateway:
    """The gateway, when the caller is its operator; else 403 with the reason."""
    gw: Gateway = request.app.state.gateway
    if principal_of(request.state).key is not None:
        raise PermissionDeniedError(NOT_OPERATOR)
    if writes and gw.config.api_key is None:
        raise PermissionDeniedError(OPEN_SERVER)
    return gw


def _keys(gw: Gateway) -> Keys:
    if gw.keys is None:
        raise ServiceUnavailableError("this server keeps no tenants' keys")
    return gw.keys


def metric_samples(gw: Gateway) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every counter, gauge and histogram (sum and count) the gateway exports, by sample name."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in gw.metrics.registry.collect():
        for sample in family.samples:
            if family.type == "histogram" and not sample.name.endswith(_HISTOGRAM_KEPT):
                continue
            if sample.name.endswith("_created"):
                continue
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def _engine(gw: Gateway) -> dict[str, Any] | None:
    stats = gw.upstream.stats()
    if stats is None:
        return None
    return asdict(stats)  # its tiers too


def _fleet(gw: Gateway) -> dict[str, Any] | None:
    from gateway.backends.fleet.upstream import FleetUpstream, fleet_view

    up = gw.upstream
    if not isinstance(up, FleetUpstream):
        return None
    view = msgspec.to_builtins(fleet_view(up.fleet))
    policy = up.fleet.canary.policy
    view["rollbacks"] = [
        {"version": v, "reason": r.reason, "requests": r.requests, "description": r.describe(policy)}
        for v, r in up.fleet.canary.rolled_back.items()
    ]
    return view


def snapshot(gw: Gateway) -> dict[str, Any]:
    fleet = _fleet(gw)
    return {
        "time": time.time(),
        "server": {
            "role": "gateway" if fleet is None else "router",
            "started": gw.created,
            "not_ready": gw.not_ready_reason(),
            "keys_managed": gw.config.api_key is not None and gw.keys is not None,
        },
        "engine": _engine(gw),
        "fleet": fleet,
        "metrics": metric_samples(gw),
    }


def _key_view(k: ApiKey) -> dict[str, Any]:
    return {
        "id": k.id,
        "shown": k.shown,
        "tenant": k.tenant,
        "name": k.name,
        "created_at": k.created_at,
        "expires_at": k.expires_at,
        "revoked_at": k.revoked_at,
        "models": None if k.limits.models is None else list(k.limits.models),
        "rpm": k.limits.rpm,
        "tpm": k.limits.tpm,
        "max_concurrent": k.limits.max_concurrent,
    }


class NewKey(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tenant: str
    name: str = ""
    models: list[str] | None = None
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    expires_in_s: float | None = None  # from now


async def _usage(gw: Gateway, snap: dict[str, Any]) -> None:
    """Replace this replica's tenant counters with every replica's, where they are shared."""
    if gw.usage is None:
        snap["server"]["usage"] = "this server's"
        return
    try:
        shared = await gw.usage.read()
    except RedisError as exc:
        snap["server"]["usage"] = f"this replica's only: the shared state (Redis) cannot be reached ({exc})"
        return
    for name in _TENANT_SAMPLES:
        snap["metrics"][name] = shared.get(name, [])
    snap["server"]["usage"] = "every replica's (shared in Redis)"


@get("/console/api/snapshot", summary="The console's view: metrics, engine, fleet", include_in_schema=False)
async def console_snapshot(request: AnyRequest) -> Response[bytes]:
    gw = operator(request)
    snap = snapshot(gw)
    await _usage(gw, snap)
    return Response(encode(snap), media_type=JSON)


@get("/console/api/keys", summary="Tenants' keys (never their secrets)", include_in_schema=False)
async def console_keys(request: AnyRequest) -> Response[bytes]:
    keys = _keys(operator(request))
    listed = await asyncio.to_thread(keys.list)
    return Response(encode({"data": [_key_view(k) for k in listed]}), media_type=JSON)


@post("/console/api/keys", summary="Make a tenant's key (its secret shown once)", include_in_schema=False)
async def console_create_key(request: AnyRequest) -> Response[bytes]:
    keys = _keys(operator(request, writes=True))
    req = decode_body(await request.body(), NewKey)
    limits = KeyLimits(
        models=None if req.models is None else tuple(req.models),
        rpm=req.rpm,
        tpm=req.tpm,
        max_concurrent=req.max_concurrent,
    )
    expires = None if req.expires_in_s is None else time.time() + req.expires_in_s
    record, secret = await asyncio.to_thread(
        lambda: keys.create(req.tenant, limits, name=req.name, expires_at=expires)
    )
    return Response(encode({**_key_view(record), "key": secret}), media_type=JSON, status_code=201)


@post("/console/api/keys/{key_id:str}/revoke", summary="Revoke a tenant's key", include_in_schema=False)
async def console_revoke_key(request: AnyRequest, key_id: FromPath[str]) -> Response[bytes]:
    keys = _keys(operator(request, writes=True))
    record = await asyncio.to_thread(keys.revoke, key_id)
    return Response(encode(_key_view(record)), media_type=JSON, status_code=200)


def _longctx(gw: Gateway) -> Path:
    return gw.config.bench_results / "longctx"


def _heatmaps(where: Path) -> list[str]:
    if not where.is_dir():
        return []
    return sorted(p.name for p in where.iterdir() if _HEATMAP.fullmatch(p.name) and p.is_file())


@get("/console/api/longctx", summary="The long-context benchmark's heatmaps", include_in_schema=False)
async def console_longctx(request: AnyRequest) -> Response[bytes]:
    where = _longctx(operator(request))
    names = await asyncio.to_thread(_heatmaps, where)
    return Response(encode({"directory": str(where), "heatmaps": names}), media_type=JSON)


@get("/console/api/longctx/{name:str}", summary="One heatmap (PNG)", include_in_schema=False)
async def console_heatmap(request: AnyRequest, name: FromPath[str]) -> Response[bytes]:
    where = _longctx(operator(request))
    if _HEATMAP.fullmatch(name) is None:  # a file name of the bench's own, never a path
        raise NotFoundError(f"no heatmap {name!r}: the bench writes heatmap-CONFIG.png")
    try:
        data = await asyncio.to_thread((where / name).read_bytes)
    except OSError:
        raise NotFoundError(f"no heatmap {name!r} in {where}") from None
    return Response(data, media_type="image/png")


ROUTES = [
    console_snapshot,
    console_keys,
    console_create_key,
    console_revoke_key,
    console_longctx,
    console_heatmap,
]
