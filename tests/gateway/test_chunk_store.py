"""The chunk store: content-addressed, verified, LRU-bounded in bytes, persistent and thread-safe.

Chunks here are tiny (100 bytes) and budgets a few chunks, so eviction orders can be asserted exactly.
"""

from __future__ import annotations

import random
import sqlite3
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.edge.chunk_store import ChunkStore
from shared.chunking import digest
from shared.compression import ChunkError

SIZE = 100  # bytes per test chunk
T = "tenant-a"  # the tenant every chunk here is stored and read as


def chunk(label: str) -> tuple[bytes, bytes]:
    data = label.encode().ljust(SIZE, b".")
    return digest(data), data


A, B, C, D, E = (chunk(label) for label in "abcde")


def held(store: ChunkStore, *chunks: tuple[bytes, bytes]) -> list[bool]:
    """Whether each chunk is stored (without touching the LRU order)."""
    absent = set(store.missing([d for d, _ in chunks], tenant=T))
    return [d not in absent for d, _ in chunks]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "chunks.db"  # a parent that does not exist yet


@pytest.fixture
def store(path: Path) -> Iterator[ChunkStore]:
    with ChunkStore(path, max_bytes=3 * SIZE) as s:
        yield s


# -- contents -------------------------------------------------------------------------------------


def test_put_then_get_many_returns_the_bytes_and_leaves_out_absent_ones(store: ChunkStore) -> None:
    store.put(*A, tenant=T)
    store.put_many(dict([B]), tenant=T)
    assert store.get_many([A[0], C[0], B[0]], tenant=T) == dict([A, B])
    assert (store.count, store.total_bytes) == (2, 2 * SIZE)


def test_missing_keeps_request_order_and_names_each_digest_once(store: ChunkStore) -> None:
    store.put(*B, tenant=T)
    assert store.missing([C[0], A[0], B[0], C[0], D[0], A[0]], tenant=T) == [C[0], A[0], D[0]]


def test_putting_a_stored_chunk_again_changes_nothing_but_its_recency(store: ChunkStore) -> None:
    store.put(*A, tenant=T)
    store.put(*A, tenant=T)
    store.put_many(dict([A, B]), tenant=T)
    assert (store.count, store.total_bytes) == (2, 2 * SIZE)


def test_bytes_that_do_not_match_their_digest_are_refused_and_nothing_is_stored(store: ChunkStore) -> None:
    with pytest.raises(ChunkError, match="does not match"):
        store.put_many({A[0]: A[1], B[0]: C[1]}, tenant=T)
    with pytest.raises(ChunkError):
        store.put(A[0][:16], A[1], tenant=T)  # a truncated digest never matches
    assert store.count == 0
    assert held(store, A, B, C) == [False, False, False]


def test_hits_and_misses_count_each_digest_looked_up(store: ChunkStore) -> None:
    store.put_many(dict([A, B]), tenant=T)
    store.missing([A[0], C[0], A[0]], tenant=T)
    store.get_many([B[0], D[0], E[0]], tenant=T)
    assert (store.hits, store.misses) == (2, 3)


# -- LRU eviction ---------------------------------------------------------------------------------


def test_eviction_removes_the_least_recently_used_first(store: ChunkStore) -> None:
    store.put(*A, tenant=T)
    store.put(*B, tenant=T)
    store.put(*C, tenant=T)
    store.get_many([A[0]], tenant=T)  # order, oldest first: B C A
    store.put(*D, tenant=T)  # over budget by one chunk: B goes
    assert held(store, A, B, C, D) == [True, False, True, True]
    store.put(*A, tenant=T)  # re-putting touches: C D A
    store.put(*E, tenant=T)
    assert held(store, A, B, C, D, E) == [True, False, False, True, True]
    assert (store.count, store.total_bytes) == (3, 3 * SIZE)


def test_get_many_touches_in_request_order(store: ChunkStore) -> None:
    store.put_many(dict([A, B, C]), tenant=T)
    store.get_many([C[0], A[0], B[0]], tenant=T)  # order: C A B
    store.put(*D, tenant=T)
    assert held(store, A, B, C, D) == [True, True, False, True]


def test_missing_does_not_touch(store: ChunkStore) -> None:
    store.put_many(dict([A, B, C]), tenant=T)
    store.missing([A[0]], tenant=T)
    store.put(*D, tenant=T)
    assert held(store, A, B, C, D) == [False, True, True, True]


def test_a_calls_own_chunks_are_never_evicted_even_over_budget(path: Path) -> None:
    with ChunkStore(path, max_bytes=2 * SIZE) as store:
        store.put_many(dict([A, B, C]), tenant=T)  # 3 chunks > 2-chunk budget: all kept, for now
        assert held(store, A, B, C) == [True, True, True]
        assert store.total_bytes == 3 * SIZE
        # D is new; A and B are named by the same request and kept; C is the only one evictable.
        store.put_many(dict([D]), touch=[A[0], B[0]], tenant=T)
        assert held(store, A, B, C, D) == [True, True, False, True]
        store.put(*E, tenant=T)  # order was D A B: the two oldest go
        assert held(store, A, B, C, D, E) == [False, True, False, False, True]


def test_touched_chunks_that_are_absent_are_ignored(store: ChunkStore) -> None:
    store.put_many(dict([A]), touch=[B[0], A[0]], tenant=T)
    assert (store.count, store.total_bytes) == (1, SIZE)


# -- tenants --------------------------------------------------------------------------------------


def test_a_chunk_is_held_only_by_the_tenants_that_put_it_and_stored_once(store: ChunkStore) -> None:
    store.put_many(dict([A, B]), tenant=T)
    assert store.missing([A[0], B[0]], tenant="other") == [A[0], B[0]]
    assert store.sizes([A[0]], tenant="other") == {}
    assert store.get_many([A[0], B[0]], tenant="other") == {}
    store.put_many(dict([A]), tenant="other")
    assert store.get_many([A[0], B[0]], tenant="other") == dict([A])
    assert (store.count, store.total_bytes) == (2, 2 * SIZE)  # A's bytes once, for both tenants


def test_touching_another_tenants_chunk_does_not_keep_it(path: Path) -> None:
    with ChunkStore(path, max_bytes=2 * SIZE) as store:
        store.put_many(dict([A, B]), tenant=T)  # order: A B
        store.put_many({}, touch=[A[0]], tenant="other")  # not its chunk: nothing changes
        store.put_many(dict([C]), tenant=T)  # evicts the oldest, A
        assert held(store, A, B, C) == [False, True, True]
        store.put_many(dict([A]), tenant="other")  # evicts B; A is held by "other" only
        assert store.missing([A[0], B[0], C[0]], tenant=T) == [A[0], B[0]]
        with sqlite3.connect(path) as db:  # an evicted chunk leaves no owner behind
            assert db.execute("SELECT COUNT(*) FROM chunk_owners WHERE digest = ?", (B[0],)).fetchone() == (
                0,
            )


@given(st.lists(st.tuples(st.booleans(), st.lists(st.sampled_from("abcdefgh"), max_size=4)), max_size=25))
@settings(max_examples=40, deadline=None)
def test_contents_follow_an_lru_model_over_any_sequence_of_calls(calls: list[tuple[bool, list[str]]]) -> None:
    budget = 3 * SIZE
    model: OrderedDict[bytes, None] = OrderedDict()  # digest, oldest first

    def model_touch(digests: list[bytes]) -> None:
        for d in digests:
            if d in model:
                model.move_to_end(d)

    with tempfile.TemporaryDirectory() as tmp, ChunkStore(Path(tmp) / "c.db", max_bytes=budget) as store:
        for is_put, labels in calls:
            items = dict(chunk(label) for label in labels)
            if is_put:
                store.put_many(items, tenant=T)
                for d in items:
                    model[d] = None
                    model.move_to_end(d)
                victims = [d for d in model if d not in items][: max(0, len(model) - budget // SIZE)]
                for d in victims:
                    del model[d]
            else:
                store.get_many(list(items), tenant=T)
                model_touch(list(items))
            assert store.missing(list(model), tenant=T) == []
            assert store.count == len(model)


# -- persistence ----------------------------------------------------------------------------------


def test_a_restart_keeps_chunks_counts_and_lru_order(path: Path) -> None:
    with ChunkStore(path, max_bytes=3 * SIZE) as store:
        store.put_many(dict([A, B, C]), tenant=T)
        store.get_many([A[0]], tenant=T)  # order: B C A
    with ChunkStore(path, max_bytes=3 * SIZE) as store:
        assert (store.count, store.total_bytes) == (3, 3 * SIZE)
        assert store.get_many([C[0]], tenant=T) == dict([C])  # order: B A C
        store.put(*D, tenant=T)
        assert held(store, A, B, C, D) == [True, False, True, True]


def test_reopening_with_a_smaller_budget_evicts_the_oldest(path: Path) -> None:
    with ChunkStore(path, max_bytes=3 * SIZE) as store:
        store.put_many(dict([A, B, C]), tenant=T)
    with ChunkStore(path, max_bytes=SIZE) as store:
        assert held(store, A, B, C) == [False, False, True]
        assert (store.count, store.total_bytes) == (1, SIZE)


def test_a_budget_must_be_positive(path: Path) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        ChunkStore(path, max_bytes=0)


# -- threads --------------------------------------------------------------------------------------


def test_concurrent_puts_and_gets_from_threads_keep_the_store_consistent(path: Path) -> None:
    pool = [chunk(f"chunk-{i}") for i in range(40)]
    budget = 20 * SIZE
    errors: list[BaseException] = []

    def worker(store: ChunkStore, seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(60):
                picked = rng.sample(pool, rng.randint(1, 6))
                if rng.random() < 0.5:
                    store.put_many(dict(picked[:3]), touch=[d for d, _ in picked[3:]], tenant=T)
                else:
                    for d, data in store.get_many([d for d, _ in picked], tenant=T).items():
                        if digest(data) != d:
                            raise AssertionError("get_many returned the bytes of another chunk")
                store.missing([d for d, _ in picked], tenant=T)
        except BaseException as e:  # a thread's failure is reported by the test's thread
            errors.append(e)

    with ChunkStore(path, max_bytes=budget) as store:
        threads = [threading.Thread(target=worker, args=(store, seed)) for seed in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        count, total = store.count, store.total_bytes
        assert store.hits + store.misses > 0
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT digest, data, size FROM chunks").fetchall()
    assert (count, total) == (len(rows), sum(size for _, _, size in rows))
    assert total <= budget
    assert all(digest(data) == d and len(data) == size for d, data, size in rows)
