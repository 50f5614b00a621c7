"""Canary releases: the policy's validation, the sliding window's pruning, bounds and p99, the weighted
split under a seeded rng, pins, and the automatic rollback rules (error rate, latency against the
stable version, the minimum counts that keep noise from deciding, and never the stable version)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from gateway.backends.fleet.canary import CanaryController, CanaryPolicy, Rollback, VersionWindow


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


POLICY = CanaryPolicy(error_rate=0.05, latency_ratio=3.0, window_s=60.0, min_requests=20)


def controller(
    weights: dict[str, float] | None = None, stable: str | None = None
) -> tuple[CanaryController, Clock]:
    clock = Clock()
    return CanaryController(weights or {"v1": 90, "v2": 10}, POLICY, clock, stable=stable), clock


def feed(
    ctl: CanaryController, version: str, n: int, ok: bool = True, latency_s: float = 0.1
) -> list[Rollback]:
    return [r for _ in range(n) if (r := ctl.record(version, ok, latency_s)) is not None]


# -- policy


def test_the_default_policy_is_five_percent_errors_three_times_latency_over_a_minute() -> None:
    assert CanaryPolicy() == CanaryPolicy(error_rate=0.05, latency_ratio=3.0, window_s=60.0, min_requests=20)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"error_rate": 0}, "error_rate"),
        ({"error_rate": 1.5}, "error_rate"),
        ({"error_rate": float("nan")}, "error_rate"),
        ({"latency_ratio": 1.0}, "latency_ratio"),
        ({"window_s": 0}, "window_s"),
        ({"window_s": -1}, "window_s"),
        ({"min_requests": 0}, "min_requests"),
    ],
)
def test_an_invalid_policy_is_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CanaryPolicy(**kwargs)


def test_an_error_rate_of_one_is_allowed() -> None:
    assert CanaryPolicy(error_rate=1.0).error_rate == 1.0


# -- window


def test_an_empty_window_has_no_p99_and_no_errors() -> None:
    window = VersionWindow(60.0, Clock())
    assert window.count == 0 and window.successes == 0
    assert window.error_rate() == 0.0
    assert window.p99() is None


def test_the_window_counts_errors_and_successes() -> None:
    window = VersionWindow(60.0, Clock())
    for i in range(10):
        window.add(ok=i % 5 != 0, latency_s=0.1)
    assert window.count == 10 and window.successes == 8
    assert window.error_rate() == pytest.approx(0.2)


def test_p99_is_the_nearest_rank_over_successful_requests_only() -> None:
    window = VersionWindow(60.0, Clock())
    for ms in range(1, 201):  # 1..200 ms
        window.add(ok=True, latency_s=ms / 1000)
    window.add(ok=False, latency_s=30.0)  # a timeout: counted as an error, not in the latency tail
    assert window.p99() == pytest.approx(0.198)  # rank ceil(0.99 * 200) = 198
    assert window.error_rate() == pytest.approx(1 / 201)


def test_p99_of_a_small_sample_is_its_maximum() -> None:
    window = VersionWindow(60.0, Clock())
    for latency in (0.3, 0.1, 0.2):
        window.add(ok=True, latency_s=latency)
    assert window.p99() == 0.3


def test_a_window_of_only_failures_has_no_p99() -> None:
    window = VersionWindow(60.0, Clock())
    window.add(ok=False, latency_s=1.0)
    assert window.p99() is None and window.error_rate() == 1.0


def test_outcomes_older_than_the_window_are_pruned_on_read() -> None:
    clock = Clock()
    window = VersionWindow(60.0, clock)
    for _ in range(5):
        window.add(ok=False, latency_s=5.0)
    clock.advance(30)
    for _ in range(5):
        window.add(ok=True, latency_s=0.1)
    assert window.count == 10 and window.error_rate() == 0.5 and window.p99() == 0.1
    clock.advance(30)  # the first five are exactly window_s old: out
    assert window.count == 5 and window.error_rate() == 0.0
    clock.advance(30)
    assert window.count == 0 and window.p99() is None


def test_the_p99_follows_pruning() -> None:
    clock = Clock()
    window = VersionWindow(60.0, clock)
    window.add(ok=True, latency_s=9.0)
    clock.advance(1)
    window.add(ok=True, latency_s=0.1)
    assert window.p99() == 9.0
    clock.advance(59.5)
    assert window.p99() == 0.1


def test_the_window_keeps_at_most_max_outcomes_dropping_the_oldest() -> None:
    window = VersionWindow(60.0, Clock(), max_outcomes=100)
    for _ in range(50):
        window.add(ok=False, latency_s=1.0)
    for _ in range(100):
        window.add(ok=True, latency_s=0.1)
    assert window.count == 100
    assert window.error_rate() == 0.0  # the failures were the oldest, and were dropped with their count
    assert window.p99() == 0.1


def test_the_default_bound_is_ten_thousand_outcomes() -> None:
    window = VersionWindow(60.0, Clock())
    for _ in range(10_050):
        window.add(ok=True, latency_s=0.1)
    assert window.count == 10_000


def naive_p99(latencies: list[float]) -> float | None:
    ordered = sorted(latencies)
    return ordered[math.ceil(0.99 * len(ordered)) - 1] if ordered else None


def test_the_incremental_counts_match_a_naive_recomputation() -> None:
    # The window keeps error counts and a sorted latency list in step with its outcomes instead of
    # sorting on each read; this holds them equal to recomputing from the kept outcomes, across
    # pruning by time, dropping by the bound, and repeated latencies.
    rng = random.Random(42)
    clock = Clock()
    window = VersionWindow(10.0, clock, max_outcomes=300)
    kept: list[tuple[float, bool, float]] = []
    for i in range(5_000):
        # First fast (the bound of 300 is what drops outcomes), then slow (the 10 s window is).
        clock.advance(rng.choice([0.0, 0.001, 0.01] if i < 2_500 else [0.01, 0.1]))
        ok, latency = rng.random() > 0.2, rng.choice([0.05, 0.1, 0.2, rng.uniform(0, 3)])
        window.add(ok, latency)
        kept = [o for o in [*kept, (clock.now, ok, latency)] if o[0] > clock.now - 10.0][-300:]
        successes = [lat for _, good, lat in kept if good]
        assert window.count == len(kept)
        assert window.successes == len(successes)
        assert window.error_rate() == pytest.approx(1 - len(successes) / len(kept))
        assert window.p99() == naive_p99(successes)


@pytest.mark.parametrize("latency", [-0.1, float("nan"), float("inf")])
def test_a_nonsense_latency_is_refused(latency: float) -> None:
    with pytest.raises(ValueError, match="latency_s"):
        VersionWindow(60.0, Clock()).add(ok=True, latency_s=latency)


# -- versions and pick


def test_the_stable_version_is_the_one_with_the_largest_weight() -> None:
    ctl, _ = controller({"v1": 10, "v2": 90, "v3": 5})
    assert ctl.stable == "v2"
    assert ctl.state("v2") == "stable" and ctl.state("v1") == "canary" and ctl.state("v3") == "canary"


def test_a_tie_for_the_largest_weight_must_be_settled_by_the_operator() -> None:
    with pytest.raises(ValueError, match="tie"):
        controller({"v1": 50, "v2": 50})
    ctl, _ = controller({"v1": 50, "v2": 50}, stable="v2")
    assert ctl.stable == "v2" and ctl.state("v1") == "canary"


def test_an_explicit_stable_version_overrides_the_weights() -> None:
    ctl, _ = controller({"v1": 90, "v2": 10}, stable="v2")
    assert ctl.state("v2") == "stable" and ctl.state("v1") == "canary"


@pytest.mark.parametrize(
    ("weights", "stable", "match"),
    [
        ({}, None, "at least one"),
        ({"v1": -1, "v2": 5}, None, "v1"),
        ({"v1": float("inf")}, None, "v1"),
        ({"v1": 1}, "v9", "v9"),
    ],
)
def test_invalid_versions_are_refused(weights: dict, stable: str | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CanaryController(weights, POLICY, Clock(), stable=stable)


def test_a_version_with_no_weight_is_idle_and_reachable_only_by_pin() -> None:
    ctl, _ = controller({"v1": 100, "v2": 0})
    assert ctl.state("v2") == "idle"
    rng = random.Random(1)
    assert {ctl.pick(rng) for _ in range(1000)} == {"v1"}
    assert ctl.pick(rng, pinned="v2") == "v2"
    assert feed(ctl, "v2", 50, ok=False) == []  # an idle version has no traffic share to roll back


def test_picks_follow_the_weights() -> None:
    ctl, _ = controller({"v1": 90, "v2": 10})
    rng = random.Random(1234)
    counts = Counter(ctl.pick(rng) for _ in range(10_000))
    assert set(counts) == {"v1", "v2"}
    assert counts["v2"] / 10_000 == pytest.approx(0.10, abs=0.01)


def test_picks_follow_three_way_weights() -> None:
    ctl, _ = controller({"v1": 70, "v2": 20, "v3": 10})
    rng = random.Random(99)
    counts = Counter(ctl.pick(rng) for _ in range(20_000))
    assert counts["v1"] / 20_000 == pytest.approx(0.70, abs=0.015)
    assert counts["v2"] / 20_000 == pytest.approx(0.20, abs=0.015)
    assert counts["v3"] / 20_000 == pytest.approx(0.10, abs=0.015)


def test_the_same_seed_gives_the_same_picks() -> None:
    ctl, _ = controller()
    a, b = random.Random(7), random.Random(7)
    assert [ctl.pick(a) for _ in range(200)] == [ctl.pick(b) for _ in range(200)]


def test_a_pin_to_a_known_version_returns_it() -> None:
    ctl, _ = controller()
    rng = random.Random(0)
    assert all(ctl.pick(rng, pinned="v2") == "v2" for _ in range(100))


def test_a_pin_to_an_unknown_version_is_none() -> None:
    ctl, _ = controller()
    assert ctl.pick(random.Random(0), pinned="v9") is None


def test_no_pick_when_no_version_has_weight() -> None:
    ctl, _ = controller({"v1": 0, "v2": 0}, stable="v1")
    assert ctl.pick(random.Random(0)) is None
    assert ctl.pick(random.Random(0), pinned="v1") == "v1"


# -- rollback


def test_a_canary_over_the_error_rate_is_rolled_back() -> None:
    ctl, _ = controller()
    feed(ctl, "v2", 18)
    rollbacks = feed(ctl, "v2", 2, ok=False)  # 2 errors in 20 = 10% > 5%
    assert len(rollbacks) == 1
    rollback = rollbacks[0]
    assert rollback.version == "v2" and rollback.reason == "error_rate"
    assert rollback.error_rate == pytest.approx(0.10) and rollback.requests == 20
    assert ctl.weights == {"v1": 90, "v2": 0}
    assert ctl.state("v2") == "rolled_back"
    assert ctl.rolled_back == {"v2": rollback}
    assert "error rate 10.0% > 5.0%" in rollback.describe(POLICY)


def test_an_error_rate_at_the_threshold_is_not_a_breach() -> None:
    ctl, _ = controller()
    feed(ctl, "v2", 19)
    assert feed(ctl, "v2", 1, ok=False) == []  # 1 in 20 = exactly 5%
    assert ctl.state("v2") == "canary"


def test_no_verdict_before_min_requests() -> None:
    ctl, _ = controller()
    assert feed(ctl, "v2", 19, ok=False) == []  # 100% errors, but only 19 outcomes
    assert ctl.state("v2") == "canary" and ctl.weights["v2"] == 10
    assert len(feed(ctl, "v2", 1, ok=False)) == 1


def test_old_errors_leave_the_window_and_do_not_count() -> None:
    ctl, clock = controller()
    feed(ctl, "v2", 10, ok=False)
    clock.advance(61)
    assert feed(ctl, "v2", 20) == []
    assert ctl.error_rate("v2") == 0.0 and ctl.state("v2") == "canary"


def test_a_canary_far_slower_than_the_stable_version_is_rolled_back() -> None:
    ctl, _ = controller()
    feed(ctl, "v1", 20, latency_s=0.1)
    assert feed(ctl, "v2", 19, latency_s=0.5) == []
    rollbacks = feed(ctl, "v2", 1, latency_s=0.5)  # p99 0.5s > 3 x 0.1s
    assert len(rollbacks) == 1
    rollback = rollbacks[0]
    assert rollback.reason == "latency" and rollback.error_rate == 0.0
    assert rollback.p99_s == 0.5 and rollback.stable_p99_s == 0.1
    assert ctl.weights["v2"] == 0
    assert "p99 0.500s > 3 x stable p99 0.100s" in rollback.describe(POLICY)


def test_a_canary_within_the_latency_ratio_stays() -> None:
    ctl, _ = controller()
    feed(ctl, "v1", 20, latency_s=0.1)
    assert feed(ctl, "v2", 100, latency_s=0.3) == []  # exactly 3x is not over it
    assert ctl.state("v2") == "canary"


def test_no_latency_verdict_without_enough_stable_successes() -> None:
    ctl, _ = controller()
    feed(ctl, "v1", 19, latency_s=0.1)
    feed(ctl, "v1", 30, ok=False, latency_s=0.1)  # failures do not make a latency baseline
    assert feed(ctl, "v2", 50, latency_s=5.0) == []
    assert ctl.state("v2") == "canary"
    feed(ctl, "v1", 1, latency_s=0.1)
    assert len(feed(ctl, "v2", 1, latency_s=5.0)) == 1  # judged on the canary's next request


def test_the_stable_version_is_never_rolled_back() -> None:
    ctl, _ = controller()
    feed(ctl, "v2", 20, latency_s=0.01)
    assert feed(ctl, "v1", 200, ok=False, latency_s=10.0) == []
    assert ctl.state("v1") == "stable" and ctl.weights["v1"] == 90
    assert ctl.error_rate("v1") == 1.0


def test_a_pin_to_a_rolled_back_version_is_honoured() -> None:
    ctl, _ = controller()
    feed(ctl, "v2", 20, ok=False)
    assert ctl.state("v2") == "rolled_back"
    rng = random.Random(3)
    assert {ctl.pick(rng) for _ in range(1000)} == {"v1"}
    assert ctl.pick(rng, pinned="v2") == "v2"


def test_a_rolled_back_version_stays_rolled_back() -> None:
    ctl, clock = controller()
    [first] = feed(ctl, "v2", 20, ok=False)
    clock.advance(3600)
    assert feed(ctl, "v2", 100) == []  # pinned traffic, all fine: still no re-promotion
    assert ctl.weights["v2"] == 0 and ctl.state("v2") == "rolled_back"
    assert feed(ctl, "v2", 100, ok=False) == []  # and no second rollback
    assert ctl.rolled_back == {"v2": first}


def test_each_canary_is_judged_on_its_own() -> None:
    ctl, _ = controller({"v1": 80, "v2": 10, "v3": 10})
    feed(ctl, "v3", 20)
    [rollback] = feed(ctl, "v2", 20, ok=False)
    assert rollback.version == "v2"
    assert ctl.state("v3") == "canary" and ctl.weights == {"v1": 80, "v2": 0, "v3": 10}


def test_metrics_accessors_report_per_version_figures() -> None:
    ctl, _ = controller()
    feed(ctl, "v1", 3, latency_s=0.2)
    feed(ctl, "v1", 1, ok=False)
    assert ctl.count("v1") == 4 and ctl.error_rate("v1") == 0.25 and ctl.p99("v1") == 0.2
    assert ctl.count("v2") == 0 and ctl.p99("v2") is None
    assert ctl.versions == ["v1", "v2"]


def test_the_returned_views_are_copies() -> None:
    ctl, _ = controller()
    ctl.weights["v2"] = 0
    ctl.rolled_back["v2"] = Rollback("v2", "error_rate", 1.0, None, None, 20)
    assert ctl.weights["v2"] == 10 and ctl.state("v2") == "canary"


@pytest.mark.parametrize("call", ["record", "state", "error_rate", "p99", "count"])
def test_an_unknown_version_is_an_error_naming_it(call: str) -> None:
    ctl, _ = controller()
    args: tuple = ("v9", True, 0.1) if call == "record" else ("v9",)
    with pytest.raises(ValueError, match="v9"):
        getattr(ctl, call)(*args)
