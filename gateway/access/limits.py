"""Per-key limits, enforced before dispatch: requests per minute, tokens per minute and requests in
flight (gateway/access/keys.py holds each key's numbers).

Requests and tokens are counted over a sliding 60-second window. A request's tokens are reserved as
prompt + max_tokens when it is dispatched and settled to what it really used (prompt + completion)
when it ends, so a burst cannot overrun the minute by asking for more than it then generates, and a
short answer gives its unused reservation back. A refusal says which limit and when a retry can
pass (`Retry-After`); every answer carries OpenAI's `x-ratelimit-*` headers for its key.

Two implementations of one `Limiter`: `RateLimiter` here keeps the windows in this process (one
replica; all state on the event loop's thread, no locks), and access/limits_redis.py keeps them in
Redis for every replica (`--redis-url`). Admission, reservation and the headers are awaited (Redis
answers them); settling and releasing are not (they change nothing the answer depends on).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from gateway.access.keys import ApiKey, KeyLimits
from gateway.seam import Generation
from shared.engine_types import RequestOutput

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class Limited:
    """A refusal: the limit that was hit, a message for the client and seconds until a retry fits."""

    limit: str  # "requests" | "tokens" | "concurrency"
    message: str
    retry_after_s: float

    @staticmethod
    def too_many_tokens(tokens: int, tpm: int) -> Limited:
        """A request that could not fit in the key's minute even alone."""
        return Limited(
            "tokens",
            f"the request may use {tokens} tokens (prompt + max_tokens), more than this key's "
            f"{tpm} tokens per minute; lower max_tokens or shorten the prompt",
            WINDOW_S,
        )


def concurrency_refusal(max_concurrent: int) -> Limited:
    return Limited(
        "concurrency",
        f"this key may have {max_concurrent} requests in flight; wait for one to finish",
        1.0,
    )


@dataclass(slots=True)
class _Spend:
    """Tokens one request reserved at `at`, then what it used: settled in place, so a key with many
    requests in its window settles each in constant time."""

    at: float
    tokens: int


@dataclass(slots=True)
class _Usage:
    requests: deque[float] = field(default_factory=deque)  # admission times in the window
    tokens: deque[_Spend] = field(default_factory=deque)  # reservations in the window, oldest first
    token_sum: int = 0
    in_flight: int = 0

    def expire(self, now: float) -> None:
        while self.requests and self.requests[0] <= now - WINDOW_S:
            self.requests.popleft()
        while self.tokens and self.tokens[0].at <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft().tokens


@dataclass(slots=True)
class Ticket:
    """One admitted request: released once (its in-flight slot), its tokens settled once."""

    key_id: str
    spend: _Spend | None = None  # its reservation, until settled (this process's limiter)
    released: bool = False
    token: str = ""  # names it in Redis (limits_redis.py)
    reserved: bool = False  # it holds a reservation in Redis, until settled
    used: int | None = None  # settled while still running: sent to Redis with the release
    # (requests, seconds to reset, tokens, seconds to reset) as Redis last answered for it
    window: tuple[int, float, int, float] | None = None


class Limiter(Protocol):
    """Per-key limits: admit a request (requests per minute, in flight), reserve its most tokens,
    settle them to what it used, release its slot; and the x-ratelimit-* headers of a key."""

    async def admit(self, key: ApiKey) -> Ticket | Limited: ...

    async def reserve(self, key: ApiKey, ticket: Ticket, tokens: int) -> Limited | None: ...

    def settle(self, ticket: Ticket, used: int) -> None: ...

    def release(self, ticket: Ticket) -> None: ...

    async def headers(self, key: ApiKey, ticket: Ticket | None = None) -> list[tuple[bytes, bytes]]: ...


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._usage: dict[str, _Usage] = {}

    def _of(self, key: ApiKey) -> _Usage:
        usage = self._usage.setdefault(key.id, _Usage())
        usage.expire(self._clock())
        return usage

    async def admit(self, key: ApiKey) -> Ticket | Limited:
        """Count a new request against the key's requests per minute and in-flight limits."""
        now = self._clock()
        usage, lim = self._of(key), key.limits
        if lim.max_concurrent is not None and usage.in_flight >= lim.max_concurrent:
            return concurrency_refusal(lim.max_concurrent)
        if lim.rpm is not None and len(usage.requests) >= lim.rpm:
            wait = usage.requests[0] + WINDOW_S - now
            return Limited("requests", f"rate limit of {lim.rpm} requests per minute reached", wait)
        usage.requests.append(now)
        usage.in_flight += 1
        return Ticket(key.id)

    async def reserve(self, key: ApiKey, ticket: Ticket, tokens: int) -> Limited | None:
        """Reserve a request's most tokens (prompt + max_tokens) against tokens per minute."""
        tpm = key.limits.tpm
        if tpm is None:
            return None
        if tokens > tpm:
            return Limited.too_many_tokens(tokens, tpm)
        now = self._clock()
        usage = self._of(key)
        if usage.token_sum + tokens > tpm:
            return Limited(
                "tokens",
                f"rate limit of {tpm} tokens per minute reached ({usage.token_sum} used or reserved, "
                f"this request may use {tokens})",
                _tokens_free_in(usage, tpm - tokens, now),
            )
        ticket.spend = _Spend(now, tokens)
        usage.tokens.append(ticket.spend)
        usage.token_sum += tokens
        return None

    def settle(self, ticket: Ticket, used: int) -> None:
        """Replace the reservation with the tokens the request really used (once)."""
        usage, spend = self._usage.get(ticket.key_id), ticket.spend
        ticket.spend = None
        if usage is None or spend is None:
            return
        # a spend that left the window was subtracted at its reserved size: only one still in it counts
        if usage.tokens and usage.tokens[0].at <= spend.at:
            usage.token_sum += used - spend.tokens
        spend.tokens = used

    def release(self, ticket: Ticket) -> None:
        """The request ended: free its in-flight slot (once)."""
        if ticket.released:
            return
        ticket.released = True
        usage = self._usage.get(ticket.key_id)
        if usage is not None:
            usage.in_flight -= 1

    async def headers(self, key: ApiKey, ticket: Ticket | None = None) -> list[tuple[bytes, bytes]]:
        """OpenAI's x-ratelimit-* headers for the key's limits (none for an unlimited key)."""
        now = self._clock()
        usage = self._of(key)
        req_reset = usage.requests[0] + WINDOW_S - now if usage.requests else 0.0
        tok_reset = usage.tokens[0].at + WINDOW_S - now if usage.tokens else 0.0
        return rate_headers(key.limits, len(usage.requests), req_reset, usage.token_sum, tok_reset)


def rate_headers(
    lim: KeyLimits, requests: int, requests_reset_s: float, tokens: int, tokens_reset_s: float
) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* headers from a key's window: requests and tokens in it, and seconds
    until the oldest of each leaves it."""
    out: list[tuple[bytes, bytes]] = []
    if lim.rpm is not None:
        out += _triple("requests", lim.rpm, lim.rpm - requests, requests_reset_s)
    if lim.tpm is not None:
        out += _triple("tokens", lim.tpm, lim.tpm - tokens, tokens_reset_s)
    return out


def _tokens_free_in(usage: _Usage, room: int, now: float) -> float:
    """Seconds until the window's total falls to `room` or below, as its oldest entries expire."""
    total = usage.token_sum
    for spend in usage.tokens:
        if total <= room:
            break
        total -= spend.tokens
        wait = spend.at + WINDOW_S - now
        if total <= room:
            return max(wait, 0.0)
    return 0.0


def _triple(kind: str, limit: int, remaining: int, reset_s: float) -> list[tuple[bytes, bytes]]:
    return [
        (f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()),
        (f"x-ratelimit-remaining-{kind}".encode(), str(max(remaining, 0)).encode()),
        (f"x-ratelimit-reset-{kind}".encode(), f"{max(math.ceil(reset_s), 0)}s".encode()),
    ]


class SettleOnClose:
    """The generations of one request, wrapped so that the tokens they produce are counted and the
    key's reservation is settled to prompt + those tokens once every one of them is closed (every
    route closes its generations when the response ends, streamed or not)."""

    def __init__(self, limiter: Limiter, ticket: Ticket, prompt_tokens: int) -> None:
        self._limiter = limiter
        self._ticket = ticket
        self._used = prompt_tokens
        self._open = 0

    def wrap(self, gen: Generation) -> Generation:
        self._open += 1
        return _Counted(gen, self)

    def nothing_used(self) -> None:
        """The request was never taken (the engine refused it): nothing is charged."""
        self._limiter.settle(self._ticket, 0)

    def _count(self, tokens: int) -> None:
        self._used += tokens

    def _closed(self) -> None:
        self._open -= 1
        if self._open == 0:
            self._limiter.settle(self._ticket, self._used)


class _Counted:
    def __init__(self, gen: Generation, meter: SettleOnClose) -> None:
        self.request_id = gen.request_id
        self._gen = gen
        self._meter = meter
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for out in self._gen:
            self._meter._count(len(out.token_ids))
            yield out

    def close(self) -> None:
        self._gen.close()
        if not self._closed:
            self._closed = True
            self._meter._closed()
