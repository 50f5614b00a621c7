"""The per-backend circuit breaker, driven by a hand-moved clock: every transition, the one-probe rule
of half-open, the timeout that keeps a lost probe from wedging it, and the on_change callback."""

from __future__ import annotations

import pytest

from gateway.backends.fleet.circuit import CircuitBreaker, CircuitState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(failures_to_open: int = 3, cooldown_s: float = 10.0) -> tuple[CircuitBreaker, Clock, list]:
    clock = Clock()
    changes: list[tuple[CircuitState, CircuitState]] = []
    breaker = CircuitBreaker(
        failures_to_open, cooldown_s, clock, on_change=lambda a, b: changes.append((a, b))
    )
    return breaker, clock, changes


def open_it(breaker: CircuitBreaker) -> None:
    for _ in range(breaker.failures_to_open):
        breaker.record_failure()
    assert breaker.state == "open"


def test_a_new_breaker_is_closed_and_allows_every_request() -> None:
    breaker, _, changes = make()
    assert breaker.state == "closed"
    assert all(breaker.allow() for _ in range(100))
    assert breaker.opened_count == 0 and breaker.last_reason is None and changes == []


def test_it_opens_after_the_configured_consecutive_failures_and_refuses_requests() -> None:
    breaker, _, changes = make(failures_to_open=3)
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.record_failure("connection refused")
    assert breaker.state == "open"
    assert not breaker.allow()
    assert breaker.opened_count == 1
    assert breaker.last_reason == "3 consecutive failures: connection refused"
    assert changes == [("closed", "open")]


def test_a_success_resets_the_consecutive_failure_count() -> None:
    breaker, _, _ = make(failures_to_open=3)
    for _ in range(5):
        breaker.record_failure()
        breaker.record_failure()
        breaker.record_success()
        assert breaker.consecutive_failures == 0
    assert breaker.state == "closed"


def test_it_stays_open_until_the_cooldown_has_passed_then_reports_half_open() -> None:
    breaker, clock, changes = make(cooldown_s=10.0)
    open_it(breaker)
    clock.advance(9.999)
    assert breaker.state == "open" and not breaker.allow()
    clock.advance(0.001)
    assert breaker.state == "half_open"
    assert changes == [("closed", "open"), ("open", "half_open")]


def test_half_open_lets_exactly_one_probe_through() -> None:
    breaker, clock, _ = make()
    open_it(breaker)
    clock.advance(10)
    assert breaker.allow()
    clock.advance(5)
    assert [breaker.allow() for _ in range(10)] == [False] * 10
    assert breaker.state == "half_open"


def test_a_successful_probe_closes_the_breaker() -> None:
    breaker, clock, changes = make()
    open_it(breaker)
    clock.advance(10)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed"
    assert all(breaker.allow() for _ in range(10))
    assert changes == [("closed", "open"), ("open", "half_open"), ("half_open", "closed")]


def test_a_failed_probe_reopens_with_a_fresh_cooldown() -> None:
    breaker, clock, changes = make()
    open_it(breaker)
    clock.advance(10)
    assert breaker.allow()
    clock.advance(3)
    breaker.record_failure("HTTP 503")
    assert breaker.state == "open" and not breaker.allow()
    assert breaker.opened_count == 2
    assert breaker.last_reason == "half-open probe failed: HTTP 503"
    clock.advance(9.9)  # the new cool-down counts from the failed probe, not from the first opening
    assert breaker.state == "open"
    clock.advance(0.1)
    assert breaker.state == "half_open" and breaker.allow()
    assert changes == [
        ("closed", "open"),
        ("open", "half_open"),
        ("half_open", "open"),
        ("open", "half_open"),
    ]


def test_a_probe_that_never_reports_does_not_wedge_the_breaker() -> None:
    breaker, clock, _ = make(cooldown_s=10.0)
    open_it(breaker)
    clock.advance(10)
    assert breaker.allow()  # this caller crashes and never records a result
    clock.advance(9.9)
    assert not breaker.allow()
    clock.advance(0.1)
    assert breaker.allow()  # a second probe, a cool-down after the lost one
    assert not breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed"


def test_a_closed_breaker_needs_a_full_run_of_failures_to_reopen() -> None:
    breaker, clock, _ = make(failures_to_open=3)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_failure()
    clock.advance(10)
    breaker.allow()
    breaker.record_success()
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state == "closed"


def test_results_recorded_while_open_are_ignored() -> None:
    breaker, clock, changes = make()
    open_it(breaker)
    clock.advance(5)
    breaker.record_success()  # a straggler let through before the breaker opened
    assert breaker.state == "open"
    breaker.record_failure()
    clock.advance(5)
    assert breaker.state == "half_open"  # the straggler's failure did not restart the cool-down
    assert breaker.opened_count == 1 and len(changes) == 2


def test_trip_opens_a_closed_breaker_at_once() -> None:
    breaker, _, changes = make()
    breaker.trip("health check: connection refused")
    assert breaker.state == "open" and not breaker.allow()
    assert breaker.opened_count == 1
    assert breaker.last_reason == "health check: connection refused"
    assert changes == [("closed", "open")]


def test_trip_while_open_restarts_the_cooldown_without_a_new_transition() -> None:
    breaker, clock, changes = make()
    breaker.trip("down")
    clock.advance(8)
    breaker.trip("still down")
    clock.advance(8)
    assert breaker.state == "open"
    assert breaker.opened_count == 1 and breaker.last_reason == "still down"
    clock.advance(2)
    assert breaker.state == "half_open"
    assert changes == [("closed", "open"), ("open", "half_open")]


def test_trip_while_half_open_reopens() -> None:
    breaker, clock, changes = make()
    breaker.trip("down")
    clock.advance(10)
    assert breaker.allow()
    breaker.trip("down again")
    assert breaker.state == "open" and not breaker.allow()
    assert breaker.opened_count == 2
    assert changes[-1] == ("half_open", "open")


def test_the_callback_is_optional_and_can_be_set_later() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures_to_open=1, clock=clock)
    breaker.record_failure()
    assert breaker.state == "open"
    seen: list[tuple[CircuitState, CircuitState]] = []
    breaker.on_change = lambda a, b: seen.append((a, b))
    clock.advance(10)
    assert breaker.state == "half_open"
    assert seen == [("open", "half_open")]


def test_the_defaults_open_after_five_failures_and_cool_down_for_ten_seconds() -> None:
    clock = Clock()
    breaker = CircuitBreaker(clock=clock)
    for _ in range(4):
        breaker.record_failure()
    assert breaker.state == "closed"
    breaker.record_failure()
    assert breaker.state == "open"
    clock.advance(10)
    assert breaker.state == "half_open"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"failures_to_open": 0}, "failures_to_open"),
        ({"cooldown_s": 0}, "cooldown_s"),
        ({"cooldown_s": float("nan")}, "cooldown_s"),
    ],
)
def test_invalid_settings_are_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CircuitBreaker(**kwargs)
