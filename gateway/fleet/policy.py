"""Which backend takes a request, among those that can.

- `random`: uniformly.
- `least-load`: the least loaded (load = work there relative to what it runs at once).
- `prefix`: the backend holding the longest prefix of the request, scored against its load
  (score = share of the prompt's blocks it holds - load), so a hot prefix stays on its holder until
  the holder is busy and then spreads; busy backends are considered only when all are busy.

Ties always break at random, never to the first listed: a fixed order piles equal traffic onto one
backend (a recurring router bug).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from .backend import FleetBackend
from .config import Policy

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
    pool = [c for c in candidates if not c.busy()] or candidates
    share = {c.name: matched.get(c.name, 0) / total[c.name] if total.get(c.name) else 0.0 for c in pool}
    b = _best(pool, {c.name: share[c.name] - min(c.load(), 1.0) for c in pool}, rng)
    if matched.get(b.name, 0) > 0:
        return Decision(b, "affinity_hit", matched[b.name])
    spilled = any(matched.get(c.name, 0) > 0 for c in candidates)
    return Decision(b, "load_spill" if spilled else "least_load", 0)
