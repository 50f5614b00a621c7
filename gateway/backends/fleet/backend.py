"""One backend as the router sees it: what it is (a ctxfuse worker or another OpenAI-compatible
server), its circuit, its load (reported by a worker, and counted here as requests in flight), and
where its block events were read up to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.backends.fleet.circuit import CircuitBreaker
from gateway.backends.fleet.config import BackendSpec
from shared.fleet_protocol import WorkerLoad

ResolvedKind = Literal["ctxfuse", "openai"]


@dataclass(slots=True)
class FleetBackend:
    spec: BackendSpec
    circuit: CircuitBreaker
    kind: ResolvedKind | None = None  # None until the first health check says (kind "auto")
    in_flight: int = 0  # requests this gateway has open to it
    reported: WorkerLoad | None = None  # a worker's own figures, from the last state poll
    block_size: int | None = None
    epoch: str | None = None  # the worker process whose block events we follow
    next_event: int = 0
    draining: bool = False
    reachable: bool = True  # the last active health check got an answer
    models: list[str] = field(default_factory=list)  # what it serves, as it reports (empty: not known)
    max_model_len: int | None = None  # its context, as its state or model list reports it

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def reports_blocks(self) -> bool:
        return self.kind == "ctxfuse" and self.block_size is not None

    def load(self) -> float:
        """Work queued on it relative to what it runs at once: >= 1 means requests wait there."""
        r = self.reported
        if r is None:
            return self.in_flight / self.spec.max_concurrency
        # the report lags by up to a poll; what this gateway sent since is in in_flight
        return max(r.running + r.waiting, self.in_flight) / max(1, r.max_num_seqs)

    def busy(self) -> bool:
        r = self.reported
        if r is not None and r.waiting > 0:
            return True
        return self.load() >= 1.0

    def serves(self, model: str | None) -> bool:
        """Whether a request naming `model` may go here (a backend that has not said what it serves
        is tried: its own 404 then answers)."""
        return model is None or not self.models or model in self.models

    def may_take_work(self) -> bool:
        """Routable now, or after one probe: reachable, and its circuit closed or half-open (a router
        whose backends came up after it is ready; its first request is the probe)."""
        return self.reachable and not self.draining and self.kind is not None and self.circuit.state != "open"

    def takes_work(self) -> bool:
        """Routable now without asking the circuit for a probe."""
        return (
            self.reachable and not self.draining and self.kind is not None and self.circuit.state == "closed"
        )
