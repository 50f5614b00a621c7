"""Per-key limits and keys shared by gateway replicas through a real Redis: two limiters (two
replicas' views) over one Redis hold one window per key, a revocation made through one store is
seen by the other, and an unreachable Redis refuses (503) rather than admitting without limits."""

from __future__ import annotations

import asyncio

import pytest

from gateway.access.keys import ApiKey, KeyLimits
from gateway.access.keys_redis import RedisKeyStore
from gateway.access.limits import WINDOW_S, Limited, Ticket
from gateway.access.limits_redis import RedisLimiter
from gateway.shared_state.redis_link import RedisLink, SharedStateDown
from tests.redis_rig import unreachable_url


def _key(**limits: int) -> ApiKey:
    return ApiKey("k1", "acme", "", 0.0, None, None, KeyLimits(**limits))  # type: ignore[arg-type]


def _two(url: str) -> tuple[RedisLimiter, RedisLimiter]:
    return RedisLimiter(RedisLink(url)), RedisLimiter(RedisLink(url))


def test_requests_per_minute_hold_across_replicas(redis_url: str) -> None:
    a, b = _two(redis_url)
    key = _key(rpm=5)

    async def go() -> list[Ticket | Limited]:
        return [await (a if i % 2 else b).admit(key) for i in range(12)]

    outcomes = asyncio.run(go())
    assert sum(isinstance(o, Ticket) for o in outcomes) == 5
    refused = [o for o in outcomes if isinstance(o, Limited)]
    assert {o.limit for o in refused} == {"requests"}
    assert all(0 < o.retry_after_s <= WINDOW_S for o in refused)


def test_concurrent_admissions_on_two_replicas_never_pass_the_limit(redis_url: str) -> None:
    a, b = _two(redis_url)
    key = _key(rpm=7)

    async def go() -> list[Ticket | Limited]:
        return list(await asyncio.gather(*((a if i % 2 else b).admit(key) for i in range(40))))

    assert sum(isinstance(o, Ticket) for o in asyncio.run(go())) == 7


def test_tokens_reserved_on_one_replica_settle_and_count_on_the_other(redis_url: str) -> None:
    a, b = _two(redis_url)
    key = _key(tpm=1000)

    async def go() -> None:
        t1 = await a.admit(key)
        t2 = await b.admit(key)
        assert isinstance(t1, Ticket) and isinstance(t2, Ticket)
        assert await a.reserve(key, t1, 600) is None
        refused = await b.reserve(key, t2, 500)
        assert isinstance(refused, Limited) and refused.limit == "tokens"
        assert 0 < refused.retry_after_s <= WINDOW_S
        a.settle(t1, 100)  # the answer was short: 500 of the 600 come back
        a.settle(t1, 999)  # once: a second settle changes nothing
        a.release(t1)  # the request ends: its settlement goes with the release
        await asyncio.gather(*a._pending)
        assert await b.reserve(key, t2, 500) is None
        headers = dict(await b.headers(key))
        assert headers[b"x-ratelimit-remaining-tokens"] == b"400"

    asyncio.run(go())


def test_requests_in_flight_are_counted_across_replicas_and_freed_on_release(redis_url: str) -> None:
    a, b = _two(redis_url)
    key = _key(max_concurrent=2)

    async def go() -> None:
        first, second = await a.admit(key), await b.admit(key)
        assert isinstance(first, Ticket) and isinstance(second, Ticket)
        refused = await a.admit(key)
        assert isinstance(refused, Limited) and refused.limit == "concurrency"
        b.release(second)
        await asyncio.gather(*b._pending)
        third = await a.admit(key)
        assert isinstance(third, Ticket)
        assert await a.reserve(_key(tpm=100), third, 60) is None
        a.release(third)  # released first, settled after (a background task's end): still counted
        a.settle(third, 10)
        await asyncio.gather(*a._pending)
        assert dict(await b.headers(_key(tpm=100)))[b"x-ratelimit-remaining-tokens"] == b"90"

    asyncio.run(go())


def test_an_unreachable_redis_refuses_admission_rather_than_admitting_unlimited() -> None:
    limiter = RedisLimiter(RedisLink(unreachable_url()))
    with pytest.raises(SharedStateDown) as err:
        asyncio.run(limiter.admit(_key(rpm=5)))
    assert err.value.status == 503 and "Redis" in str(err.value)


def test_a_key_revoked_through_one_replica_is_refused_by_the_other(redis_url: str) -> None:
    a, b = RedisKeyStore(RedisLink(redis_url)), RedisKeyStore(RedisLink(redis_url))
    record, secret = a.create("acme", KeyLimits(rpm=3), name="ci")
    found = b.lookup(secret)
    assert found is not None and found.tenant == "acme" and found.limits.rpm == 3
    assert b.lookup(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    assert [k.id for k in b.list("acme")] == [record.id] and b.has_keys()
    b.revoke(record.id)
    assert a.lookup(secret) is None
    new, new_secret = a.create("acme")
    assert b.lookup(new_secret) is not None and new.id != record.id


def test_rotating_a_key_revokes_the_old_one_for_every_replica(redis_url: str) -> None:
    a, b = RedisKeyStore(RedisLink(redis_url)), RedisKeyStore(RedisLink(redis_url))
    record, secret = a.create("acme", KeyLimits(tpm=500))
    new, new_secret = b.rotate(record.id)
    assert a.lookup(secret) is None
    again = a.lookup(new_secret)
    assert again is not None and again.limits.tpm == 500 and again.id == new.id
