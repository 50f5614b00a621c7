"""Which backend takes a request, among those that can.

- `random`: uniformly.
- `least-load`: the least loaded (load = work there relative to what it runs at once).
- `prefix`: the backend holding the longest prefix of the request, scored against its load
  (score = share of the prompt's blocks it holds - load), so a hot prefix stays on its holder until
  the holder is busy and then spreads; busy backends are considered only when all are busy.
  The decision is an `affinity_hit` when the chosen backend holds the longest match of all, a
  `load_spill` when another holds more, and `least_load` when none holds any.

Ties always break at random, never to the first listed: a fixed order piles equal traffic onto one
backend (a recurring router bug).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from gateway.backends.fleet.backend import FleetBackend
from gateway.backends.fleet.config import Policy

DecisionKind = Literal["affinity_hit", "load_spill", "least_load", "random", "probe"]


@dataclass(frozen=True, slots=True)
class Decision:
    backend: FleetBackend
    kind: DecisionKind
    matched: int  # prefix keys the chosen backend holds


def _best(backends: list[FleetBackend], score: dict[str, float], rng: random.Random) -> FleetBackend:
    top = max(score[b.name] for b in backends)
    return rng.choice([b for b in backends if score[b.name] >= top - 1e-9])


def choose(
    policy: Policy,
    candidates: list[FleetBackend],
    matched: dict[str, int],
    total: dict[str, int],
    rng: random.Random,
) -> Decision:
    """`matched[name]`: leading prefix keys it holds; `total[name]`: the request's keys in its scheme."""
    if not candidates:
        raise ValueError("no candidate backend")
    if policy == "random":
        b = rng.choice(candidates)
        return Decision(b, "random", matched.get(b.name, 0))
    if policy == "least-load":
        b = _best(candidates, {c.name: -c.load() for c in candidates}, rng)
        return Decision(b, "least_load", matched.get(b.name, 0))
    share = {c.name: matched.get(c.name, 0) / total[c.name] if total.get(c.name) else 0.0 for c in candidates}
    pool = [c for c in candidates if not c.busy()] or candidates
    b = _best(pool, {c.name: share[c.name] - min(c.load(), 1.0) for c in pool}, rng)
    # A hit only when the chosen backend holds the longest match there is: taking a backend that
    # shares a template block while another holds the whole document is a spill, not a hit.
    longest = max(share.values())
    if longest == 0.0:
        return Decision(b, "least_load", 0)
    kind: DecisionKind = "affinity_hit" if share[b.name] >= longest - 1e-9 else "load_spill"
    return Decision(b, kind, matched.get(b.name, 0))
