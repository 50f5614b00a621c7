"""A circuit breaker per backend: after repeated failures the router stops sending a backend requests,
then after a cool-down lets one probe through to find out whether it has recovered.

States and transitions (all through `_enter`, so `on_change` sees every one):
  closed    --`failures_to_open` consecutive failures, or `trip()`-->  open
  open      --`cooldown_s` passed (noticed lazily, on the next read)-->  half_open
  half_open --the probe succeeds-->  closed
  half_open --the probe fails, or `trip()`-->  open (a fresh cool-down)

Invariants: `_probe_at` is set only while half-open, and is the time the one probe was let through;
at most one probe is outstanding, unless it has been outstanding for a whole `cooldown_s`. That
timeout exists because a probe whose caller crashed never reports, and without it the breaker would
refuse the backend forever.

Results recorded while open are ignored: they come from requests let through before it opened, and
the cool-down (not a late straggler) decides when to try the backend again. In half-open any result
counts as the probe's: a success from the backend is evidence it works, whoever asked.

Time comes only from the injected clock and the on_change callback is called synchronously; the
breaker is not thread-safe (it lives on one event loop).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

CircuitState = Literal["closed", "open", "half_open"]
OnChange = Callable[[CircuitState, CircuitState], None]


class CircuitBreaker:
    def __init__(
        self,
        failures_to_open: int = 5,
        cooldown_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        on_change: OnChange | None = None,
    ) -> None:
        if failures_to_open < 1:
            raise ValueError(f"failures_to_open must be at least 1, got {failures_to_open}")
        if not cooldown_s > 0:
            raise ValueError(f"cooldown_s must be positive, got {cooldown_s}")
        self.failures_to_open = failures_to_open
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.on_change = on_change
        # How many times it has gone to open, and why the last time: for metrics and logs.
        self.opened_count = 0
        self.last_reason: str | None = None
        self._state: CircuitState = "closed"
        self._failures = 0  # consecutive, counted only while closed
        self._opened_at = 0.0
        self._probe_at: float | None = None

    @property
    def state(self) -> CircuitState:
        self._advance()
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def allow(self) -> bool:
        """Whether a request may go to this backend now. In half-open a True is the probe: the caller
        must record its result, and until it does (or a cool-down passes) everyone else gets False."""
        self._advance()
        if self._state == "closed":
            return True
        if self._state == "open":
            return False
        now = self.clock()
        if self._probe_at is not None and now - self._probe_at < self.cooldown_s:
            return False
        self._probe_at = now
        return True

    def record_success(self) -> None:
        self._advance()
        if self._state == "closed":
            self._failures = 0
        elif self._state == "half_open":
            self._enter("closed")

    def record_failure(self, reason: str | None = None) -> None:
        """A request to the backend failed (`reason`, if given, is kept in `last_reason`)."""
        self._advance()
        if self._state == "closed":
            self._failures += 1
            if self._failures >= self.failures_to_open:
                self._open(_with_detail(f"{self._failures} consecutive failures", reason))
        elif self._state == "half_open":
            self._open(_with_detail("half-open probe failed", reason))

    def trip(self, reason: str) -> None:
        """Open at once (an active health check found the backend down). Already open, the cool-down
        starts again: the backend has just been seen down."""
        self._open(reason)

    def _open(self, reason: str) -> None:
        self.last_reason = reason
        self._opened_at = self.clock()
        self._failures = 0
        if self._state != "open":
            self.opened_count += 1
            self._enter("open")

    def _advance(self) -> None:
        # The open -> half_open edge is driven by time, so it is taken whenever anyone looks.
        if self._state == "open" and self.clock() - self._opened_at >= self.cooldown_s:
            self._enter("half_open")

    def _enter(self, new: CircuitState) -> None:
        old, self._state = self._state, new
        self._probe_at = None
        if new == "closed":
            self._failures = 0
        if self.on_change is not None and old != new:
            self.on_change(old, new)


def _with_detail(what: str, reason: str | None) -> str:
    return what if reason is None else f"{what}: {reason}"
