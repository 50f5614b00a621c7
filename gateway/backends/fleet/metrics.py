"""The fleet's Prometheus metrics, in the gateway's registry (served at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CIRCUIT_VALUE = {"closed": 0, "half_open": 1, "open": 2}
CANARY_VALUE = {"stable": 0, "canary": 1, "rolled_back": 2, "idle": 3}


class FleetMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "ctxfuse_backend_requests", "Requests sent to each backend", ["backend", "version"], registry=r
        )
        self.errors = Counter(
            "ctxfuse_backend_errors",
            "Failed requests by backend and kind (connect, timeout, status, stream)",
            ["backend", "kind"],
            registry=r,
        )
        self.latency = Histogram(
            "ctxfuse_backend_first_byte_seconds",
            "From sending a request to a backend to its first response byte",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.circuit = Gauge(
            "ctxfuse_backend_circuit_state", "0 closed, 1 half-open, 2 open", ["backend"], registry=r
        )
        self.in_flight = Gauge(
            "ctxfuse_backend_in_flight", "Requests open to each backend", ["backend"], registry=r
        )
        self.decisions = Counter(
            "ctxfuse_routing_decisions",
            "Routing decisions: affinity_hit, load_spill, least_load, random, probe (half-open circuit)",
            ["decision"],
            registry=r,
        )
        self.retries = Counter(
            "ctxfuse_routing_retries",
            "Requests sent again to another backend before the first byte",
            registry=r,
        )
        self.index_keys = Gauge("ctxfuse_prefix_index_keys", "Prefix keys the router remembers", registry=r)
        self.canary_state = Gauge(
            "ctxfuse_canary_state",
            "0 stable, 1 canary, 2 rolled back, 3 idle (reached by pin only)",
            ["version"],
            registry=r,
        )
        self.canary_weight = Gauge(
            "ctxfuse_canary_weight", "Traffic weight of each version", ["version"], registry=r
        )
        self.rollbacks = Counter(
            "ctxfuse_canary_rollbacks", "Automatic rollbacks of a canary version", ["version"], registry=r
        )
