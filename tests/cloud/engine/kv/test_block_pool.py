"""The block pool on tiny pools: exact block ids, reference counts, LRU eviction of cached prefixes,
"does not fit" as a value, and block hash chaining."""

from __future__ import annotations

import pytest

from cloud.engine.kv.block_pool import BlockPool
from shared.block_hash import hash_block

H0 = hash_block(None, [1, 2, 3, 4])
H1 = hash_block(H0, [5, 6, 7, 8])


def ref_counts(pool: BlockPool) -> list[int]:
    return [b.ref_count for b in pool.blocks]


def test_pool_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_hands_out_ids_in_order_with_one_reference_each() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert ref_counts(pool) == [1, 1, 1, 0]
    assert pool.num_free == 1
    assert pool.usage == 0.75
    assert pool.allocate(0) == []
    assert pool.num_free == 1


def test_allocate_that_does_not_fit_returns_none_and_changes_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, H0)
    pool.free([0])  # block 0: free but still caching H0
    assert pool.allocate(4) is None
    assert pool.num_free == 3
    assert ref_counts(pool) == [0, 1, 0, 0]
    assert pool.lookup(H0) == 0
    assert pool.blocks[0].block_hash == H0
    # the free queue is untouched too: never-used blocks first, then the freed one
    assert pool.allocate(3) == [2, 3, 0]


def test_touch_and_free_count_references() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.touch([0])
    pool.touch([0])
    assert ref_counts(pool) == [3, 1, 0, 0]
    pool.free([0])
    assert ref_counts(pool) == [2, 1, 0, 0]
    assert pool.num_free == 2
    pool.free([0, 1])
    assert ref_counts(pool) == [1, 0, 0, 0]
    assert pool.num_free == 3
    pool.free([0])
    assert ref_counts(pool) == [0, 0, 0, 0]
    assert pool.num_free == 4


def test_eviction_takes_least_recently_freed_block_first() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) == [2, 3]
    pool.free([2])
    pool.free([0])
    pool.free([3])
    pool.free([1])
    # never-used blocks 4 and 5 were queued at start, then the frees in the order they happened
    assert pool.allocate(6) == [4, 5, 2, 0, 3, 1]


def test_request_blocks_are_freed_tail_first_so_the_head_is_evicted_last() -> None:
    pool = BlockPool(4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([0, 1, 2, 3])
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) == [2]
    assert pool.allocate(2) == [1, 0]


def test_touch_revives_a_cached_free_block_with_its_hash() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, H0)
    pool.cache(1, H1)
    pool.free([0, 1])
    assert pool.num_free == 4
    assert pool.lookup(H0) == 0
    pool.touch([0])
    assert ref_counts(pool) == [1, 0, 0, 0]
    assert pool.num_free == 3
    assert pool.blocks[0].block_hash == H0
    assert pool.lookup(H0) == 0
    # the revived block is out of the free queue: allocation cannot evict it
    assert pool.allocate(3) == [2, 3, 1]
    assert pool.lookup(H0) == 0
    assert pool.blocks[0].block_hash == H0


def test_reusing_a_block_for_other_tokens_evicts_its_hash() -> None:
    pool = BlockPool(2)
    assert pool.allocate(2) == [0, 1]
    pool.cache(1, H1)
    pool.cache(0, H0)
    pool.free([0, 1])  # queue: 1, 0
    assert pool.allocate(1) == [1]
    assert pool.lookup(H1) is None
    assert pool.blocks[1].block_hash is None
    assert pool.cached == {H0: 0}
    assert pool.allocate(1) == [0]
    assert pool.cached == {}
    assert pool.blocks[0].block_hash is None


def test_a_duplicate_hash_keeps_the_first_block_in_the_cache() -> None:
    pool = BlockPool(3)
    assert pool.allocate(2) == [0, 1]
    pool.cache(0, H0)
    pool.cache(1, H0)  # the same prefix computed twice: both hold the same KV
    assert pool.lookup(H0) == 0
    assert pool.blocks[1].block_hash == H0
    pool.free([1])
    assert pool.allocate(2) == [2, 1]  # evicting the duplicate leaves the cached entry alone
    assert pool.lookup(H0) == 0
    pool.free([0])
    assert pool.allocate(1) == [0]
    assert pool.lookup(H0) is None


def test_cache_does_not_rename_a_block_that_already_has_a_hash() -> None:
    pool = BlockPool(2)
    assert pool.allocate(1) == [0]
    pool.cache(0, H0)
    pool.cache(0, H1)
    assert pool.blocks[0].block_hash == H0
    assert pool.cached == {H0: 0}


def test_prefix_caching_off_caches_nothing() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    assert pool.allocate(1) == [0]
    pool.cache(0, H0)
    assert pool.cached == {}
    assert pool.blocks[0].block_hash is None
    assert pool.lookup(H0) is None


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    assert pool.allocate(1) == [0]
    pool.free([0])
    with pytest.raises(RuntimeError, match="block 0"):
        pool.free([0])
    with pytest.raises(RuntimeError, match="block 1"):
        pool.free([1])  # never taken
    assert pool.num_free == 2
    assert ref_counts(pool) == [0, 0]


def test_hash_is_deterministic_and_16_bytes() -> None:
    assert hash_block(None, [1, 2, 3, 4]) == H0
    assert len(H0) == 16
    assert hash_block(H0, [5, 6, 7, 8]) == H1


def test_hash_chains_the_parent() -> None:
    other_parent = hash_block(None, [9, 9, 9, 9])
    assert hash_block(other_parent, [5, 6, 7, 8]) != H1
    assert hash_block(None, [5, 6, 7, 8]) != H1


def test_hash_depends_on_tokens_and_their_order() -> None:
    assert hash_block(None, [1, 2, 3, 5]) != H0
    assert hash_block(None, [4, 3, 2, 1]) != H0


def test_extra_key_changes_the_hash() -> None:
    with_key = hash_block(None, [1, 2, 3, 4], b"adapter-a")
    assert with_key != H0
    assert with_key != hash_block(None, [1, 2, 3, 4], b"adapter-b")
    assert with_key == hash_block(None, [1, 2, 3, 4], b"adapter-a")
    assert hash_block(H0, [5, 6, 7, 8], b"image") != H1
