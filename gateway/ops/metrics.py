"""Prometheus metrics at /metrics. Engine state (running, waiting, KV usage, prefix-cache counters) is
read from the backend at scrape time; latencies are measured here, from the output stream each request
sees. One registry per app, so several apps (tests) can live in one process.

`ctxfuse_request_queue_seconds` is the engine's own figure: from a request's arrival in the engine to
its first admission by the scheduler (its wait in the waiting queue), reported with its first output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.engine_types import EngineStats, RequestOutput
from shared.storage_faults import FaultCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if s is None:
            return
        yield GaugeMetricFamily("ctxfuse_requests_running", "Requests in the running batch", s.num_running)
        yield GaugeMetricFamily("ctxfuse_requests_waiting", "Requests waiting to be scheduled", s.num_waiting)
        yield GaugeMetricFamily(
            "ctxfuse_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1)", s.kv_usage
        )
        yield GaugeMetricFamily(
            "ctxfuse_kv_cache_free_blocks", "KV cache blocks free or evictable", s.num_free_blocks
        )
        yield GaugeMetricFamily(
            "ctxfuse_kv_cache_bytes_per_token", "KV cache bytes one token takes", s.kv_bytes_per_token
        )
        yield CounterMetricFamily(
            "ctxfuse_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            s.prefix_queried_tokens,
        )
        yield CounterMetricFamily(
            "ctxfuse_prefix_cache_hits", "Prompt tokens served from the prefix cache", s.prefix_hit_tokens
        )
        yield CounterMetricFamily(
            "ctxfuse_grammar_cache_hits",
            "Structured requests whose grammar was compiled already",
            s.grammar_cache_hits,
        )
        yield CounterMetricFamily(
            "ctxfuse_grammar_compilations", "Grammars compiled (grammar cache misses)", s.grammar_cache_misses
        )
        yield CounterMetricFamily(
            "ctxfuse_spec_decode_draft_tokens", "Tokens drafted by speculative decoding", s.spec_draft_tokens
        )
        yield CounterMetricFamily(
            "ctxfuse_spec_decode_accepted_tokens",
            "Drafted tokens the model accepted (over draft tokens: the acceptance rate)",
            s.spec_accepted_tokens,
        )
        if s.kv_tiers:
            yield from _tier_metrics(s)


_TIER_GAUGES = (
    ("ctxfuse_kv_tier_blocks", "KV blocks held in a tier below the device pool", "blocks"),
    ("ctxfuse_kv_tier_bytes", "Bytes held in a KV tier", "bytes"),
    ("ctxfuse_kv_tier_capacity_bytes", "A KV tier's bound in bytes", "capacity_bytes"),
)
_TIER_COUNTERS = (
    ("ctxfuse_kv_tier_hits", "Prefix blocks found in a KV tier", "hits"),
    ("ctxfuse_kv_tier_misses", "Prefix blocks looked up in a KV tier and not found", "misses"),
    ("ctxfuse_kv_tier_promotions", "Blocks brought back from a KV tier to the device pool", "promotions"),
    ("ctxfuse_kv_tier_demotions", "Blocks put in a KV tier", "demotions"),
    ("ctxfuse_kv_tier_load_seconds", "Time reading KV tier blocks and copying them back", "load_seconds"),
    ("ctxfuse_kv_tier_write_errors", "Disk tier writes that failed (full, read-only)", "write_errors"),
    ("ctxfuse_kv_tier_writes_dropped", "Disk tier writes dropped (writer behind)", "writes_dropped"),
    ("ctxfuse_kv_tier_corrupt_blocks", "Damaged disk tier blocks found (deleted, recomputed)", "corrupt"),
)


def _tier_metrics(s: EngineStats) -> Iterator[Metric]:
    """Per tier (label `tier`: host, disk): what it holds and what moved through it."""
    for name, doc, field in _TIER_GAUGES:
        g = GaugeMetricFamily(name, doc, labels=["tier"])
        for t in s.kv_tiers:
            g.add_metric([t.tier], getattr(t, field))
        yield g
    for name, doc, field in _TIER_COUNTERS:
        c = CounterMetricFamily(name, doc, labels=["tier"])
        for t in s.kv_tiers:
            c.add_metric([t.tier], getattr(t, field))
        yield c


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("ctxfuse_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("ctxfuse_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "ctxfuse_time_to_first_token_seconds",
            "From the request's arrival at the gateway to its first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "ctxfuse_inter_token_latency_seconds",
            "Between consecutive generated tokens of one choice",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "ctxfuse_request_queue_seconds",
            "From a request's arrival in the engine to its first admission by the scheduler",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.http_requests = Counter(
            "ctxfuse_http_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        # per tenant (a key's, or a device's): what each is using, for quotas and dashboards
        self.tenant_requests = Counter(
            "ctxfuse_tenant_requests", "API requests by tenant and status", ["tenant", "status"], registry=r
        )
        self.tenant_tokens = Counter(
            "ctxfuse_tenant_tokens",
            "Tokens by tenant: prompt (processed) or generation",
            ["tenant", "kind"],
            registry=r,
        )
        self.edge_bytes = Counter(
            "ctxfuse_edge_received_bytes",
            "Request bytes received on the edge link, by device",
            ["device"],
            registry=r,
        )
        r.register(_EngineCollector(stats))
        r.register(FaultCollector())  # ctxfuse_storage_errors_total{store, kind}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def meter(self, arrival: float, tenant: str) -> RequestMeter:
        return RequestMeter(self, arrival, tenant)


class RequestMeter:
    """Latency and token counts of one request, fed with each output as the route consumes it."""

    def __init__(self, metrics: Metrics, arrival: float, tenant: str) -> None:
        self._m = metrics
        self.arrival = arrival
        self._prompt_tokens = metrics.tenant_tokens.labels(tenant=tenant, kind="prompt")
        self._generation_tokens = metrics.tenant_tokens.labels(tenant=tenant, kind="generation")
        self.first_token: float | None = None
        self._last: dict[int, float] = {}  # per choice: when its previous token came
        self._prompted: set[int] = set()  # prompt indices whose prompt tokens are counted

    def observe(self, out: RequestOutput, prompt_index: int = 0) -> None:
        now = time.monotonic()
        if not out.token_ids:
            return
        if self.first_token is None:
            self.first_token = now
            self._m.ttft.observe(now - self.arrival)
            if out.queue_time_s is not None:
                self._m.queue.observe(out.queue_time_s)
        if prompt_index not in self._prompted:
            self._prompted.add(prompt_index)
            self._m.prompt_tokens.inc(out.num_prompt_tokens)
            self._prompt_tokens.inc(out.num_prompt_tokens)
        key = prompt_index * 1024 + out.index
        last = self._last.get(key)
        if last is not None:
            self._m.itl.observe((now - last) / len(out.token_ids))
        self._last[key] = now
        self._m.generation_tokens.inc(len(out.token_ids))
        self._generation_tokens.inc(len(out.token_ids))
