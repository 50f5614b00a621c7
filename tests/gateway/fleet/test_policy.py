"""Routing policies: ties break at random, the least loaded wins under least-load, and prefix
affinity keeps a prefix on its holder until the holder is busy, then spills."""

from __future__ import annotations

import random
from collections import Counter

from gateway.backends.fleet.backend import FleetBackend
from gateway.backends.fleet.circuit import CircuitBreaker
from gateway.backends.fleet.config import BackendSpec
from gateway.backends.fleet.policy import choose
from shared.fleet_protocol import WorkerLoad


def backend(name: str, running: int = 0, waiting: int = 0, seqs: int = 4) -> FleetBackend:
    b = FleetBackend(
        BackendSpec(name=name, url=f"http://{name}"), CircuitBreaker(), kind="ctxfuse", block_size=16
    )
    b.reported = WorkerLoad(running=running, waiting=waiting, max_num_seqs=seqs, kv_usage=0.1)
    return b


def test_equal_backends_share_the_traffic_under_every_policy() -> None:
    rng = random.Random(0)
    bs = [backend("a"), backend("b"), backend("c")]
    for policy in ("random", "least-load", "prefix"):
        picks = Counter(choose(policy, bs, {}, {}, rng).backend.name for _ in range(3000))  # type: ignore[arg-type]
        assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 800, (policy, picks)


def test_least_load_takes_the_least_loaded() -> None:
    rng = random.Random(0)
    bs = [backend("a", running=3), backend("b", running=1), backend("c", running=2)]
    d = choose("least-load", bs, {}, {}, rng)
    assert (d.backend.name, d.kind) == ("b", "least_load")


def test_prefix_goes_to_the_holder_while_it_has_room() -> None:
    rng = random.Random(0)
    bs = [backend("a", running=2), backend("b")]
    d = choose("prefix", bs, {"a": 90, "b": 0}, {"a": 100, "b": 100}, rng)
    assert (d.backend.name, d.kind, d.matched) == ("a", "affinity_hit", 90)


def test_prefix_spills_when_the_holder_is_busy() -> None:
    rng = random.Random(0)
    bs = [backend("a", running=4, waiting=2), backend("b", running=1)]
    d = choose("prefix", bs, {"a": 90, "b": 0}, {"a": 100, "b": 100}, rng)
    assert (d.backend.name, d.kind) == ("b", "load_spill")


def test_prefix_prefers_the_longer_match_between_equally_loaded_holders() -> None:
    rng = random.Random(0)
    bs = [backend("a"), backend("b")]
    d = choose("prefix", bs, {"a": 10, "b": 60}, {"a": 100, "b": 100}, rng)
    assert d.backend.name == "b"


def test_when_all_are_busy_prefix_still_routes_by_affinity() -> None:
    rng = random.Random(0)
    bs = [backend("a", running=4, waiting=1), backend("b", running=4, waiting=3)]
    d = choose("prefix", bs, {"a": 50, "b": 0}, {"a": 100, "b": 100}, rng)
    assert (d.backend.name, d.kind) == ("a", "affinity_hit")


def test_a_draining_unreachable_or_open_backend_takes_no_new_work() -> None:
    fine, draining, gone, tripped = backend("a"), backend("b"), backend("c"), backend("d")
    draining.draining = True
    gone.reachable = False
    tripped.circuit.trip("health check failed")
    assert [b.takes_work() for b in (fine, draining, gone, tripped)] == [True, False, False, False]
    unknown = FleetBackend(BackendSpec(name="e", url="http://e"), CircuitBreaker())  # kind not yet known
    assert not unknown.takes_work()


def test_a_backend_sharing_only_a_template_block_is_a_spill_not_a_hit() -> None:
    """The chat template's first block is on every worker; the document is on one. Taking another
    worker because the holder is busy is a spill, even though that worker matches one block."""
    rng = random.Random(0)
    bs = [backend("a", running=4, waiting=2), backend("b")]
    d = choose("prefix", bs, {"a": 34, "b": 1}, {"a": 36, "b": 36}, rng)
    assert (d.backend.name, d.kind, d.matched) == ("b", "load_spill", 1)


def test_nothing_held_anywhere_is_least_load() -> None:
    rng = random.Random(0)
    bs = [backend("a", running=3), backend("b", running=1)]
    d = choose("prefix", bs, {}, {"a": 36, "b": 36}, rng)
    assert (d.backend.name, d.kind, d.matched) == ("b", "least_load", 0)
