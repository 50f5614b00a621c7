"""The block event log on tiny pools: exact stored/evicted sequences that follow the pool's `cached`
map, cursors and resets (another epoch, a cursor too old or in the future), the capacity bound, and
readers on another thread while the pool changes."""

from __future__ import annotations

import random
import threading

import pytest

from cloud.engine.kv.block_events import BlockEventLog
from cloud.engine.kv.block_pool import BlockPool
from shared.block_hash import hash_block
from shared.fleet_protocol import BlockEvents

H0 = hash_block(None, [1, 2, 3, 4])
H1 = hash_block(H0, [5, 6, 7, 8])
H2 = hash_block(H1, [9, 10, 11, 12])


def pool_with_log(num_blocks: int, capacity: int = 1024) -> tuple[BlockPool, BlockEventLog]:
    log = BlockEventLog(capacity)
    return BlockPool(num_blocks, events=log), log


def test_log_needs_room_for_one_event() -> None:
    with pytest.raises(ValueError):
        BlockEventLog(0)


def test_caching_a_block_is_a_stored_event_numbered_from_zero() -> None:
    pool, log = pool_with_log(4)
    assert log.next_event == 0
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, H0)
    pool.cache(1, H1)
    ev = log.since(log.epoch, 0)
    assert (ev.reset, ev.stored, ev.evicted, ev.next_event) == (False, [H0, H1], [], 2)
    assert log.since(log.epoch, 1).stored == [H1]
    assert log.held() == {H0, H1}


def test_a_second_block_with_the_same_hash_is_no_event() -> None:
    pool, log = pool_with_log(4)
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, H0)
    pool.cache(1, H0)  # the pool keeps block 0 for H0: nothing entered the cache
    pool.cache(0, H1)  # block 0 is named already: ignored by the pool
    assert log.next_event == 1
    assert pool.cached == {H0: 0}
    # block 1 is reused first: its copy of H0 was never the cached one, so H0 stays
    pool.free([1])
    assert pool.allocate(3) == [2, 3, 1]
    assert log.next_event == 1
    assert log.held() == {H0}


def test_reusing_a_cached_free_block_is_an_evicted_event() -> None:
    pool, log = pool_with_log(2)
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, H0)
    pool.cache(1, H1)
    pool.free([0, 1])  # tail first: block 1 is queued before block 0
    assert pool.allocate(1) == [1]
    ev = log.since(log.epoch, 2)
    assert (ev.stored, ev.evicted, ev.next_event) == ([], [H1], 3)
    assert log.held() == {H0}
    pool.cache(1, H2)
    assert pool.allocate(1) == [0]
    ev = log.since(log.epoch, 2)
    assert (ev.stored, ev.evicted, ev.next_event) == ([H2], [H1, H0], 5)


def test_changes_are_net_each_hash_after_its_last_event() -> None:
    pool, log = pool_with_log(1)
    assert pool.allocate(1) == [0]
    pool.cache(0, H0)
    pool.free([0])
    assert pool.allocate(1) == [0]  # H0 evicted
    pool.cache(0, H1)
    pool.free([0])
    assert pool.allocate(1) == [0]  # H1 evicted
    pool.cache(0, H0)  # H0 back
    ev = log.since(log.epoch, 0)
    assert (ev.stored, ev.evicted, ev.next_event) == ([H0], [H1], 5)


def test_the_current_cursor_gets_nothing_new() -> None:
    pool, log = pool_with_log(2)
    assert pool.allocate(1) == [0]
    pool.cache(0, H0)
    ev = log.since(log.epoch, log.next_event)
    assert (ev.reset, ev.stored, ev.evicted, ev.next_event) == (False, [], [], 1)


def test_another_epoch_or_none_gets_a_reset_with_every_held_hash() -> None:
    pool, log = pool_with_log(2)
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, H0)
    pool.cache(1, H1)
    for epoch in (None, "an-older-process", BlockEventLog().epoch):
        ev = log.since(epoch, 2)
        assert ev.reset and sorted(ev.stored) == sorted([H0, H1]) and ev.evicted == []
        assert (ev.epoch, ev.next_event) == (log.epoch, 2)


def test_a_cursor_in_the_future_gets_a_reset() -> None:
    pool, log = pool_with_log(2)
    assert pool.allocate(1) == [0]
    pool.cache(0, H0)
    ev = log.since(log.epoch, 2)
    assert ev.reset and ev.stored == [H0]
    assert log.since(log.epoch, -1).reset


def test_the_log_keeps_only_capacity_events_and_older_cursors_get_a_reset() -> None:
    pool, log = pool_with_log(1, capacity=3)
    assert pool.allocate(1) == [0]
    pool.cache(0, H0)  # event 0
    pool.free([0])
    assert pool.allocate(1) == [0]  # 1: H0 evicted
    pool.cache(0, H1)  # 2
    pool.free([0])
    assert pool.allocate(1) == [0]  # 3: H1 evicted; event 0 falls out
    pool.cache(0, H2)  # 4; event 1 falls out
    ev = log.since(log.epoch, 2)  # still kept: events 2, 3, 4
    assert (ev.reset, ev.stored, ev.evicted, ev.next_event) == (False, [H2], [H1], 5)
    for seq in (0, 1):
        ev = log.since(log.epoch, seq)
        assert (ev.reset, ev.stored, ev.evicted, ev.next_event) == (True, [H2], [], 5)


def random_workload(pool: BlockPool, rng: random.Random, steps: int, live: list[list[int]]) -> None:
    """Requests of a few blocks over a small token alphabet, so prefixes repeat and blocks get shared,
    duplicated, freed and reused, as the scheduler would do it (touch hits, allocate the rest, cache
    each full block, free in order). `live`: the blocks of the requests still running."""
    for _ in range(steps):
        if live and (rng.random() < 0.4 or pool.num_free == 0):
            pool.free(live.pop(rng.randrange(len(live))))
            continue
        tokens = [rng.randrange(3) for _ in range(4 * rng.randint(1, 4))]
        hashes: list[bytes] = []
        for i in range(0, len(tokens), 4):
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i : i + 4]))
        hits = []
        for h in hashes:
            bid = pool.lookup(h)
            if bid is None or rng.random() < 0.2:  # sometimes miss: a duplicate block for the hash
                break
            hits.append(bid)
        revived = sum(1 for b in hits if pool.blocks[b].ref_count == 0)
        if len(hashes) - len(hits) + revived > pool.num_free:
            continue
        pool.touch(hits)
        fresh = pool.allocate(len(hashes) - len(hits))
        assert fresh is not None
        blocks = hits + fresh
        for bid, h in zip(blocks, hashes, strict=True):
            pool.cache(bid, h)
        live.append(blocks)


@pytest.mark.parametrize("seed", range(5))
def test_held_hashes_equal_the_pools_cached_keys_after_a_random_workload(seed: int) -> None:
    pool, log = pool_with_log(8, capacity=24)
    rng = random.Random(seed)
    live: list[list[int]] = []
    cursor = 0
    mirror: set[bytes] = set()  # what a router applying the changes would know
    for _ in range(40):
        random_workload(pool, rng, rng.choice([3, 25]), live)  # some rounds overflow the log: a reset
        assert log.held() == set(pool.cached)
        ev = log.since(log.epoch, cursor)
        mirror = set(ev.stored) if ev.reset else (mirror - set(ev.evicted)) | set(ev.stored)
        assert mirror == set(pool.cached)
        cursor = ev.next_event


def test_readers_on_another_thread_never_fail_while_the_pool_changes() -> None:
    pool, log = pool_with_log(16, capacity=32)
    done = threading.Event()
    errors: list[BaseException] = []
    reads = [0, 0]

    def read(i: int) -> None:
        cursor = 0
        try:
            while not done.is_set():
                ev = log.since(log.epoch, cursor)
                cursor = ev.next_event
                log.held()
                reads[i] += 1
        except BaseException as exc:  # any failure at all is what this test looks for
            errors.append(exc)

    readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in readers:
        t.start()
    try:
        rng = random.Random(7)
        live: list[list[int]] = []
        random_workload(pool, rng, 5000, live)
        while min(reads) < 10 and not errors:  # each reader has read a while before the check
            random_workload(pool, rng, 100, live)
    finally:
        done.set()
        for t in readers:
            t.join(timeout=10)
    assert errors == []
    assert log.held() == set(pool.cached)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_mirror_fed_by_since_holds_what_the_engine_holds(seed: int) -> None:
    """The engine process sends `since` deltas with its batches; the worker's mirror must follow
    through incremental changes and resets (a cursor the log no longer keeps) alike."""
    rng = random.Random(seed)
    pool, log = pool_with_log(6, capacity=8)
    mirror = BlockEventLog()
    epoch, cursor = None, 0
    hashes = [hash_block(None, [i]) for i in range(20)]
    for _ in range(300):
        free = pool.allocate(1)
        if free:
            pool.cache(free[0], rng.choice(hashes))
            pool.free(free)
        if rng.random() < 0.3:  # a batch goes out: the delta since the last one
            changes = log.since(epoch, cursor)
            mirror.apply(changes)
            epoch, cursor = changes.epoch, changes.next_event
            assert mirror.held() == log.held()
    # the mirror's own readers see a consistent stream: replaying it from zero gives what it holds
    replay = mirror.since(mirror.epoch, 0)
    if not replay.reset:
        assert set(replay.stored) == mirror.held()


def test_a_reset_delta_evicts_in_the_mirror_what_the_engine_no_longer_holds() -> None:
    mirror = BlockEventLog()
    mirror.apply(BlockEvents(epoch="e1", reset=True, stored=[H0, H1], evicted=[], next_event=2))
    cursor = mirror.next_event
    mirror.apply(BlockEvents(epoch="e2", reset=True, stored=[H1, H2], evicted=[], next_event=9))
    assert mirror.held() == {H1, H2}
    delta = mirror.since(mirror.epoch, cursor)  # its router learns exactly the difference
    assert (delta.reset, delta.stored, delta.evicted) == (False, [H2], [H0])
