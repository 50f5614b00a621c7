"""The tokens-per-minute window of one key, on a clock the test moves: reservations settle to what
was used wherever they sit in the window, and one that has left the window never counts again."""

from __future__ import annotations

from asyncio import run

from gateway.access.keys import ApiKey, KeyLimits
from gateway.access.limits import WINDOW_S, Limited, RateLimiter, Ticket


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _key(tpm: int) -> ApiKey:
    return ApiKey("k1", "acme", "", 0.0, None, None, KeyLimits(tpm=tpm))


def _remaining(limiter: RateLimiter, key: ApiKey) -> int:
    headers = dict(run(limiter.headers(key)))
    return int(headers[b"x-ratelimit-remaining-tokens"])


def _reserved(limiter: RateLimiter, key: ApiKey, tokens: int) -> Ticket:
    ticket = run(limiter.admit(key))
    assert isinstance(ticket, Ticket)
    assert run(limiter.reserve(key, ticket, tokens)) is None
    return ticket


def test_each_reservation_settles_to_its_own_use_in_any_order() -> None:
    clock, key = Clock(), _key(1000)
    limiter = RateLimiter(clock)
    tickets = []
    for _ in range(5):
        tickets.append(_reserved(limiter, key, 100))
        clock.now += 1
    assert _remaining(limiter, key) == 500
    limiter.settle(tickets[3], 10)
    limiter.settle(tickets[0], 20)
    limiter.settle(tickets[0], 99)  # once: a second settle changes nothing
    assert _remaining(limiter, key) == 1000 - (20 + 100 + 100 + 10 + 100)


def test_a_reservation_that_left_the_window_is_not_counted_again_when_it_settles() -> None:
    clock, key = Clock(), _key(1000)
    limiter = RateLimiter(clock)
    old = _reserved(limiter, key, 400)
    clock.now += WINDOW_S / 2
    _reserved(limiter, key, 300)
    clock.now += WINDOW_S / 2 + 1  # the first reservation is out of the window; a long request ends
    assert _remaining(limiter, key) == 700
    limiter.settle(old, 900)
    assert _remaining(limiter, key) == 700


def test_a_refusal_says_when_enough_of_the_window_frees() -> None:
    clock, key = Clock(), _key(1000)
    limiter = RateLimiter(clock)
    _reserved(limiter, key, 600)
    clock.now += 20
    _reserved(limiter, key, 300)
    ticket = run(limiter.admit(key))
    assert isinstance(ticket, Ticket)
    refused = run(limiter.reserve(key, ticket, 500))  # fits once the first reservation (600) expires
    assert isinstance(refused, Limited) and refused.limit == "tokens"
    assert refused.retry_after_s == WINDOW_S - 20
