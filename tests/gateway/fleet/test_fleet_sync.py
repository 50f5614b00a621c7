"""Router replicas that share a Redis tell one another what they route (fleet/shared.py): a prefix one
replica sent to a backend is in every replica's index, a canary one replica rolls back is rolled
back on every replica (and on one that starts later), and with Redis unreachable each replica goes on
routing from its own state."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from gateway.backends.fleet.canary import CanaryPolicy
from gateway.backends.fleet.config import BackendSpec, FleetConfig
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.keys import RequestKeys
from gateway.backends.fleet.metrics import FleetMetrics
from gateway.backends.fleet.shared import FleetSync
from gateway.backends.fleet.text_memo import TEXT_CHUNK_CHARS
from gateway.shared_state.redis_link import RedisLink
from tests.redis_rig import unreachable_url

CONFIG = FleetConfig(
    backends=(
        BackendSpec(name="a", url="http://127.0.0.1:9", kind="openai", version="v1", weight=90),
        BackendSpec(name="b", url="http://127.0.0.1:9", kind="openai", version="v2", weight=10),
    ),
    canary=CanaryPolicy(min_requests=3, error_rate=0.5),
)


def _replica(url: str, name: str) -> Fleet:
    fleet = Fleet(CONFIG, None, None, FleetMetrics(CollectorRegistry()))
    fleet.sync = FleetSync(fleet, RedisLink(url, replica=name))
    return fleet


async def _until(done: Callable[[], bool], what: str) -> None:
    for _ in range(500):  # a hang guard, not a speed bound
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def test_a_prefix_routed_by_one_replica_is_in_the_others_index(redis_url: str) -> None:
    async def go() -> None:
        one, two = _replica(redis_url, "r1"), _replica(redis_url, "r2")
        for f in (one, two):
            assert f.sync is not None
            f.sync.start()
            await asyncio.wait_for(f.sync.connected.wait(), 10)
        keys = RequestKeys(token_ids=[], text="The lease says. " * (3 * TEXT_CHUNK_CHARS // 16))
        one.remember(one.backends[1], keys)
        chain = keys.text_chunks()
        assert len(chain) == 3
        await _until(lambda: two.index.matched(chain, ["a", "b"]) == {"a": 0, "b": 3}, "the note arrived")
        for f in (one, two):
            assert f.sync is not None
            await f.sync.stop()

    asyncio.run(go())


def test_a_canary_rolled_back_on_one_replica_is_rolled_back_on_all_and_stays_so(redis_url: str) -> None:
    async def go() -> None:
        one, two = _replica(redis_url, "r1"), _replica(redis_url, "r2")
        for f in (one, two):
            assert f.sync is not None
            f.sync.start()
            await asyncio.wait_for(f.sync.connected.wait(), 10)
        canary = one.backends[1]
        for _ in range(3):
            one.record_outcome(canary, False, 0.1)
        assert one.canary.state("v2") == "rolled_back"
        await _until(lambda: two.canary.state("v2") == "rolled_back", "the rollback reached r2")
        assert two.canary.weights["v2"] == 0.0
        later = _replica(redis_url, "r3")  # a replica started (or restarted) after the verdict
        assert later.sync is not None
        later.sync.start()
        await asyncio.wait_for(later.sync.connected.wait(), 10)
        assert later.canary.state("v2") == "rolled_back"
        for f in (one, two, later):
            assert f.sync is not None
            await f.sync.stop()

    asyncio.run(go())


def test_with_redis_unreachable_a_replica_routes_from_its_own_state() -> None:
    async def go() -> None:
        alone = _replica(unreachable_url(), "r1")
        assert alone.sync is not None
        alone.sync.start()
        keys = RequestKeys(token_ids=[], text="x" * TEXT_CHUNK_CHARS * 2)
        alone.remember(alone.backends[0], keys)  # the note is lost; nothing raises
        assert alone.index.matched(keys.text_chunks(), ["a", "b"]) == {"a": 2, "b": 0}
        for _ in range(3):
            alone.record_outcome(alone.backends[1], False, 0.1)
        assert alone.canary.state("v2") == "rolled_back"
        await asyncio.sleep(0.1)
        assert not alone.sync.connected.is_set()
        await alone.sync.stop()

    asyncio.run(go())
