"""Canary releases: traffic split across model versions by weight, and an automatic rollback of a
canary that does worse than the stable version over a sliding window.

Choices:
- The stable version is the one with the largest weight, or the operator names it; a tie is an error
  rather than a guess, because the stable version is what the canaries are judged against and is
  never rolled back itself.
- No verdict before `min_requests` outcomes in the canary's window: with 3 requests, one error is a
  33% error rate, and rolling back on noise would make canaries flap out on their first bad luck.
- The latency rule needs the stable version's own `min_requests` *successful* outcomes too: a p99 from
  a handful of samples is its maximum, and just after a restart (or when the stable version gets
  little traffic) the comparison would be against noise. Without that baseline only the error rate
  can roll a canary back.
- p99 counts successful requests only: a failure's latency is often a fast error or a timeout, and
  either would distort the tail that users of a working version see. Failures are judged by the rate.
- A rollback sets the weight to 0 and stays: re-promoting is an operator's decision (a new deployment),
  not something to retry in a loop against users.
- A request pinned by X-Context-Version gets that version even after a rollback: an explicit pin is
  someone debugging or comparing that version on purpose, and silently answering from another
  version would mislead them. An unknown pin is `None`, for the caller to answer naming the version.
- Verdicts are taken when a canary's own outcome arrives, so evaluation costs nothing on stable
  traffic; a canary that gets traffic is judged on its next request.

Windows are bounded in time (`window_s`, pruned lazily) and in memory (`max_outcomes`, oldest dropped):
at very high rates the window is the most recent `max_outcomes` outcomes, still a fair sample.
"""

from __future__ import annotations

import bisect
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

VersionState = Literal["stable", "canary", "rolled_back", "idle"]  # idle: weight 0, reachable by pin only
RollbackReason = Literal["error_rate", "latency"]

MAX_OUTCOMES = 10_000


@dataclass(frozen=True, slots=True)
class CanaryPolicy:
    error_rate: float = 0.05  # roll back above this fraction of failed requests
    latency_ratio: float = 3.0  # roll back when canary p99 > this times the stable p99
    window_s: float = 60.0
    min_requests: int = 20

    def __post_init__(self) -> None:
        if not 0 < self.error_rate <= 1:
            raise ValueError(f"error_rate must be in (0, 1], got {self.error_rate}")
        if not self.latency_ratio > 1:
            raise ValueError(f"latency_ratio must be greater than 1, got {self.latency_ratio}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")
        if self.min_requests < 1:
            raise ValueError(f"min_requests must be at least 1, got {self.min_requests}")


@dataclass(frozen=True, slots=True)
class Outcome:
    at: float  # clock seconds
    ok: bool
    latency_s: float


@dataclass(frozen=True, slots=True)
class Rollback:
    version: str
    reason: RollbackReason
    error_rate: float
    p99_s: float | None
    stable_p99_s: float | None
    requests: int  # outcomes in the canary's window when it was judged

    def describe(self, policy: CanaryPolicy) -> str:
        if self.reason == "error_rate":
            why = f"error rate {self.error_rate:.1%} > {policy.error_rate:.1%}"
        else:
            why = f"p99 {self.p99_s:.3f}s > {policy.latency_ratio:g} x stable p99 {self.stable_p99_s:.3f}s"
        return (
            f"canary {self.version} rolled back: {why} over {self.requests} requests in {policy.window_s:g}s"
        )


class VersionWindow:
    """The outcomes of one version over the last `window_s` seconds, at most `max_outcomes` of them."""

    def __init__(
        self, window_s: float, clock: Callable[[], float] = time.monotonic, max_outcomes: int = MAX_OUTCOMES
    ) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        if max_outcomes < 1:
            raise ValueError(f"max_outcomes must be at least 1, got {max_outcomes}")
        self.window_s = window_s
        self.clock = clock
        self.max_outcomes = max_outcomes
        self._outcomes: deque[Outcome] = deque()  # oldest first
        # Kept in step with _outcomes so error_rate and p99 are O(1) reads, not a sort per request:
        self._failures = 0
        self._ok_latencies: list[float] = []  # the successful outcomes' latencies, ascending

    def add(self, ok: bool, latency_s: float) -> None:
        if not (latency_s >= 0 and math.isfinite(latency_s)):
            raise ValueError(f"latency_s must be a finite non-negative number, got {latency_s}")
        self._prune()
        if len(self._outcomes) >= self.max_outcomes:
            self._drop_oldest()
        self._outcomes.append(Outcome(self.clock(), ok, latency_s))
        if ok:
            bisect.insort(self._ok_latencies, latency_s)
        else:
            self._failures += 1

    @property
    def count(self) -> int:
        self._prune()
        return len(self._outcomes)

    @property
    def successes(self) -> int:
        self._prune()
        return len(self._ok_latencies)

    def error_rate(self) -> float:
        """The fraction of failed outcomes; 0.0 for an empty window (nothing has failed)."""
        self._prune()
        return self._failures / len(self._outcomes) if self._outcomes else 0.0

    def p99(self) -> float | None:
        """The nearest-rank 99th percentile latency of successful outcomes; None when there are none."""
        self._prune()
        latencies = self._ok_latencies
        return latencies[math.ceil(0.99 * len(latencies)) - 1] if latencies else None

    def _prune(self) -> None:
        horizon = self.clock() - self.window_s
        while self._outcomes and self._outcomes[0].at <= horizon:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        oldest = self._outcomes.popleft()
        if oldest.ok:
            del self._ok_latencies[bisect.bisect_left(self._ok_latencies, oldest.latency_s)]
        else:
            self._failures -= 1


class CanaryController:
    def __init__(
        self,
        weights: Mapping[str, float],
        policy: CanaryPolicy,
        clock: Callable[[], float] = time.monotonic,
        stable: str | None = None,
    ) -> None:
        if not weights:
            raise ValueError("weights must name at least one version")
        for version, weight in weights.items():
            if not (weight >= 0 and math.isfinite(weight)):
                raise ValueError(
                    f"weight of version {version!r} must be finite and non-negative, got {weight}"
                )
        self.policy = policy
        self.stable = _stable_version(weights, stable)
        self._weights = dict(weights)
        self._windows = {v: VersionWindow(policy.window_s, clock) for v in weights}
        self._rolled_back: dict[str, Rollback] = {}

    @property
    def weights(self) -> dict[str, float]:
        return dict(self._weights)

    @property
    def rolled_back(self) -> dict[str, Rollback]:
        return dict(self._rolled_back)

    @property
    def versions(self) -> list[str]:
        return list(self._weights)

    def pick(self, rng: random.Random, pinned: str | None = None) -> str | None:
        """A version drawn by weight, or the pinned one. None: the pin names no known version, or no
        version has any weight."""
        if pinned is not None:
            return pinned if pinned in self._weights else None
        live = [(v, w) for v, w in self._weights.items() if w > 0]
        if not live:
            return None
        return rng.choices([v for v, _ in live], weights=[w for _, w in live])[0]

    def record(self, version: str, ok: bool, latency_s: float) -> Rollback | None:
        """Feed one outcome; a Rollback when it made a canary breach the policy (its weight is now 0)."""
        self._window(version).add(ok, latency_s)
        if self.state(version) != "canary":
            return None
        rollback = self._verdict(version)
        if rollback is not None:
            self._weights[version] = 0.0
            self._rolled_back[version] = rollback
        return rollback

    def adopt(self, rollback: Rollback) -> bool:
        """A rollback another replica decided (gateway/backends/fleet/shared.py): applied here too,
        once. False: this controller has no such canary, or already rolled it back."""
        version = rollback.version
        if version not in self._weights or version == self.stable or version in self._rolled_back:
            return False
        self._weights[version] = 0.0
        self._rolled_back[version] = rollback
        return True

    def state(self, version: str) -> VersionState:
        self._window(version)
        if version == self.stable:
            return "stable"
        if version in self._rolled_back:
            return "rolled_back"
        return "canary" if self._weights[version] > 0 else "idle"

    def error_rate(self, version: str) -> float:
        return self._window(version).error_rate()

    def p99(self, version: str) -> float | None:
        return self._window(version).p99()

    def count(self, version: str) -> int:
        return self._window(version).count

    def _verdict(self, version: str) -> Rollback | None:
        policy, canary, base = self.policy, self._windows[version], self._windows[self.stable]
        requests = canary.count
        if requests < policy.min_requests:
            return None
        error_rate = canary.error_rate()
        if error_rate > policy.error_rate:
            return Rollback(version, "error_rate", error_rate, canary.p99(), base.p99(), requests)
        if base.successes < policy.min_requests:
            return None
        p99, stable_p99 = canary.p99(), base.p99()
        if p99 is not None and stable_p99 is not None and p99 > policy.latency_ratio * stable_p99:
            return Rollback(version, "latency", error_rate, p99, stable_p99, requests)
        return None

    def _window(self, version: str) -> VersionWindow:
        window = self._windows.get(version)
        if window is None:
            raise ValueError(f"unknown version {version!r}; known: {', '.join(self._weights)}")
        return window


def _stable_version(weights: Mapping[str, float], stable: str | None) -> str:
    if stable is not None:
        if stable not in weights:
            raise ValueError(f"stable version {stable!r} is not among the versions {', '.join(weights)}")
        return stable
    top = max(weights.values())
    leaders = [v for v, w in weights.items() if w == top]
    if len(leaders) > 1:
        raise ValueError(
            f"versions {', '.join(leaders)} tie for the largest weight; name the stable one explicitly"
        )
    return leaders[0]
