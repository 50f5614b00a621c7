"""Tenants' usage as every replica counts it (`--redis-url`), so each replica's console shows the same.

A replica's `ctxfuse_tenant_requests` and `ctxfuse_tenant_tokens` counters are its own (Prometheus
adds replicas up at scrape time). For the console, each replica adds what its counters gained since
its last flush to one Redis hash every `FLUSH_S` seconds, in one pipelined round trip: nothing is
added to a request's path. A console reads the hash and adds its own replica's unflushed part, so
its own latest requests show at once and the others' within `FLUSH_S`.

A flush that fails (Redis down) is not lost: the counts it carried are still unflushed, and the next
flush sends them. The console then shows this replica's own counts and says why.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import structlog
from redis.exceptions import RedisError

from gateway.ops.metrics import Metrics
from gateway.shared_state.redis_link import RedisLink

log = structlog.get_logger("ctxfuse.gateway")

FLUSH_S = 2.0
Samples = dict[str, list[tuple[dict[str, str], float]]]
_Field = tuple[str, dict[str, str]]  # (sample name, labels)


def _field(name: str, labels: dict[str, str]) -> bytes:
    return msgspec.json.encode((name, dict(sorted(labels.items()))))


class SharedUsage:
    def __init__(self, link: RedisLink, metrics: Metrics) -> None:
        self.link = link
        self.metrics = metrics
        self.key = link.key("console", "tenant-usage")
        self._flushed: dict[bytes, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        # a read between a flush's increments and its bookkeeping would count them twice
        self._lock = asyncio.Lock()

    def _counts(self) -> dict[bytes, float]:
        """This replica's tenant counters since it started, by hash field."""
        out: dict[bytes, float] = {}
        for counter in (self.metrics.tenant_requests, self.metrics.tenant_tokens):
            for family in counter.collect():
                for s in family.samples:
                    if s.name.endswith("_total"):
                        out[_field(s.name, s.labels)] = float(s.value)
        return out

    def _unflushed(self, counts: dict[bytes, float]) -> dict[bytes, float]:
        return {f: v - self._flushed.get(f, 0.0) for f, v in counts.items() if v != self._flushed.get(f, 0.0)}

    async def flush(self) -> None:
        async with self._lock:
            counts = self._counts()
            gained = self._unflushed(counts)
            if not gained:
                return
            pipe = self.link.aio.pipeline(transaction=False)
            for f, delta in gained.items():
                pipe.hincrbyfloat(self.key, f, delta)
            await pipe.execute()
            self._flushed.update((f, counts[f]) for f in gained)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                await self.flush()
                self._failing = False
            except RedisError as exc:  # kept: the next flush carries these counts too
                if not self._failing:
                    log.warning("tenant usage not shared: Redis cannot be reached", error=str(exc))
                self._failing = True

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tenant-usage-flush")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(RedisError):  # the last counts, so a stopped replica's usage stays
            await self.flush()

    async def read(self) -> Samples:
        """Every replica's tenant counters added up (this one's unflushed part included)."""
        async with self._lock:
            shared = await self.link.aio.hgetall(self.key)
            totals = {f if isinstance(f, bytes) else f.encode(): float(v) for f, v in shared.items()}
            for f, v in self._unflushed(self._counts()).items():
                totals[f] = totals.get(f, 0.0) + v
        out: Samples = {}
        for f, v in totals.items():
            name, labels = msgspec.json.decode(f, type=_Field)
            out.setdefault(name, []).append((labels, v))
        return out
