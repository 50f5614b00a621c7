"""The chunk store: content-addressed, verified, LRU-bounded in bytes, persistent and thread-safe.

Every behaviour runs against both stores (gateway/edge/stores.py): the SQLite file of one machine and
the Redis that replicas share (a real redis-server; "reopening" it is a new client over the same
keys, as a restarted or another replica sees it). Chunks here are tiny (100 bytes) and budgets a few
chunks, so eviction orders can be asserted exactly.
"""

from __future__ import annotations

import random
import sqlite3
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.edge.chunk_store import ChunkStore
from gateway.edge.chunk_store_redis import ChunkKeys, RedisChunkStore
from gateway.edge.stores import AnyChunkStore
from gateway.shared_state.redis_link import RedisLink
from shared.chunking import digest
from shared.compression import ChunkError

SIZE = 100  # bytes per test chunk
T = "tenant-a"  # the tenant every chunk here is stored and read as


def chunk(label: str) -> tuple[bytes, bytes]:
    data = label.encode().ljust(SIZE, b".")
    return digest(data), data


A, B, C, D, E = (chunk(label) for label in "abcde")


def held(store: AnyChunkStore, *chunks: tuple[bytes, bytes]) -> list[bool]:
    """Whether each chunk is stored (without touching the LRU order)."""
    absent = set(store.missing([d for d, _ in chunks], tenant=T))
    return [d not in absent for d, _ in chunks]


@dataclass
class SqliteStorage:
    """One SQLite file: `open` is the store a (re)started gateway opens on it."""

    path: Path

    def open(self, max_bytes: int) -> AnyChunkStore:
        return ChunkStore(self.path, max_bytes)

    def fresh(self) -> SqliteStorage:
        return SqliteStorage(self.path.with_name(f"{uuid.uuid4().hex}.db"))

    def rows(self) -> list[tuple[bytes, bytes]]:
        """(digest, data) of every stored chunk, read behind the store's back."""
        with sqlite3.connect(self.path) as db:
            return db.execute("SELECT digest, data FROM chunks").fetchall()

    def owners(self, d: bytes) -> int:
        with sqlite3.connect(self.path) as db:
            return int(db.execute("SELECT COUNT(*) FROM chunk_owners WHERE digest = ?", (d,)).fetchone()[0])


class RedisStorage:
    """One Redis namespace: `open` is the store a (re)started or another replica opens on it."""

    def __init__(self, url: str, namespace: str = "ctxfuse") -> None:
        self.url = url
        self.link = RedisLink(url, namespace)  # the stores' and the inspection's (closed with the test's)
        self.keys = ChunkKeys.of(self.link)

    def open(self, max_bytes: int) -> AnyChunkStore:
        return RedisChunkStore(self.link, max_bytes)

    def fresh(self) -> RedisStorage:
        return RedisStorage(self.url, f"t{uuid.uuid4().hex}")

    def rows(self) -> list[tuple[bytes, bytes]]:
        stored: dict[bytes, bytes] = self.link.sync.hgetall(self.keys.data)  # type: ignore[assignment]
        return list(stored.items())

    def owners(self, d: bytes) -> int:
        return int(self.link.sync.zlexcount(self.keys.owners, b"[" + d, b"[" + d + b"\xff"))


Storage = SqliteStorage | RedisStorage


@pytest.fixture(params=["sqlite", "redis"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "sqlite":
        return SqliteStorage(tmp_path / "state" / "chunks.db")  # a parent that does not exist yet
    return RedisStorage(request.getfixturevalue("redis_url"))


@pytest.fixture
def store(storage: Storage) -> Iterator[AnyChunkStore]:
    with storage.open(max_bytes=3 * SIZE) as s:
        yield s


# -- contents -------------------------------------------------------------------------------------


def test_put_then_get_many_returns_the_bytes_and_leaves_out_absent_ones(store: AnyChunkStore) -> None:
    store.put(*A, tenant=T)
    store.put_many(dict([B]), tenant=T)
    assert store.get_many([A[0], C[0], B[0]], tenant=T) == dict([A, B])
    assert (store.count, store.total_bytes) == (2, 2 * SIZE)


def test_missing_keeps_request_order_and_names_each_digest_once(store: AnyChunkStore) -> None:
    store.put(*B, tenant=T)
    assert store.missing([C[0], A[0], B[0], C[0], D[0], A[0]], tenant=T) == [C[0], A[0], D[0]]


def test_putting_a_stored_chunk_again_changes_nothing_but_its_recency(store: AnyChunkStore) -> None:
    store.put(*A, tenant=T)
    store.put(*A, tenant=T)
    store.put_many(dict([A, B]), tenant=T)
    assert (store.count, store.total_bytes) == (2, 2 * SIZE)


def test_bytes_that_do_not_match_their_digest_are_refused_and_nothing_is_stored(store: AnyChunkStore) -> None:
    with pytest.raises(ChunkError, match="does not match"):
        store.put_many({A[0]: A[1], B[0]: C[1]}, tenant=T)
    with pytest.raises(ChunkError):
        store.put(A[0][:16], A[1], tenant=T)  # a truncated digest never matches
    assert store.count == 0
    assert held(store, A, B, C) == [False, False, False]


def test_hits_and_misses_count_each_digest_looked_up(store: AnyChunkStore) -> None:
    store.put_many(dict([A, B]), tenant=T)
    store.missing([A[0], C[0], A[0]], tenant=T)
    store.get_many([B[0], D[0], E[0]], tenant=T)
    assert (store.hits, store.misses) == (2, 3)


# -- LRU eviction ---------------------------------------------------------------------------------


def test_eviction_removes_the_least_recently_used_first(store: AnyChunkStore) -> None:
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


def test_get_many_touches_in_request_order(store: AnyChunkStore) -> None:
    store.put_many(dict([A, B, C]), tenant=T)
    store.get_many([C[0], A[0], B[0]], tenant=T)  # order: C A B
    store.put(*D, tenant=T)
    assert held(store, A, B, C, D) == [True, True, False, True]


def test_missing_does_not_touch(store: AnyChunkStore) -> None:
    store.put_many(dict([A, B, C]), tenant=T)
    store.missing([A[0]], tenant=T)
    store.put(*D, tenant=T)
    assert held(store, A, B, C, D) == [False, True, True, True]


def test_a_calls_own_chunks_are_never_evicted_even_over_budget(storage: Storage) -> None:
    with storage.open(max_bytes=2 * SIZE) as store:
        store.put_many(dict([A, B, C]), tenant=T)  # 3 chunks > 2-chunk budget: all kept, for now
        assert held(store, A, B, C) == [True, True, True]
        assert store.total_bytes == 3 * SIZE
        # D is new; A and B are named by the same request and kept; C is the only one evictable.
        store.put_many(dict([D]), touch=[A[0], B[0]], tenant=T)
        assert held(store, A, B, C, D) == [True, True, False, True]
        store.put(*E, tenant=T)  # order was D A B: the two oldest go
        assert held(store, A, B, C, D, E) == [False, True, False, False, True]


def test_touched_chunks_that_are_absent_are_ignored(store: AnyChunkStore) -> None:
    store.put_many(dict([A]), touch=[B[0], A[0]], tenant=T)
    assert (store.count, store.total_bytes) == (1, SIZE)


# -- tenants --------------------------------------------------------------------------------------


def test_a_chunk_is_held_only_by_the_tenants_that_put_it_and_stored_once(store: AnyChunkStore) -> None:
    store.put_many(dict([A, B]), tenant=T)
    assert store.missing([A[0], B[0]], tenant="other") == [A[0], B[0]]
    assert store.sizes([A[0]], tenant="other") == {}
    assert store.get_many([A[0], B[0]], tenant="other") == {}
    store.put_many(dict([A]), tenant="other")
    assert store.get_many([A[0], B[0]], tenant="other") == dict([A])
    assert (store.count, store.total_bytes) == (2, 2 * SIZE)  # A's bytes once, for both tenants


def test_touching_another_tenants_chunk_does_not_keep_it(storage: Storage) -> None:
    with storage.open(max_bytes=2 * SIZE) as store:
        store.put_many(dict([A, B]), tenant=T)  # order: A B
        store.put_many({}, touch=[A[0]], tenant="other")  # not its chunk: nothing changes
        store.put_many(dict([C]), tenant=T)  # evicts the oldest, A
        assert held(store, A, B, C) == [False, True, True]
        store.put_many(dict([A]), tenant="other")  # evicts B; A is held by "other" only
        assert store.missing([A[0], B[0], C[0]], tenant=T) == [A[0], B[0]]
        assert storage.owners(B[0]) == 0  # an evicted chunk leaves no owner behind
        assert storage.owners(A[0]) == 1


@given(st.lists(st.tuples(st.booleans(), st.lists(st.sampled_from("abcdefgh"), max_size=4)), max_size=25))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_contents_follow_an_lru_model_over_any_sequence_of_calls(
    storage: Storage, calls: list[tuple[bool, list[str]]]
) -> None:
    budget = 3 * SIZE
    model: OrderedDict[bytes, None] = OrderedDict()  # digest, oldest first

    def model_touch(digests: list[bytes]) -> None:
        for d in digests:
            if d in model:
                model.move_to_end(d)

    with storage.fresh().open(max_bytes=budget) as store:  # empty for each example
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


def test_a_restart_keeps_chunks_counts_and_lru_order(storage: Storage) -> None:
    with storage.open(max_bytes=3 * SIZE) as store:
        store.put_many(dict([A, B, C]), tenant=T)
        store.get_many([A[0]], tenant=T)  # order: B C A
    with storage.open(max_bytes=3 * SIZE) as store:
        assert (store.count, store.total_bytes) == (3, 3 * SIZE)
        assert store.get_many([C[0]], tenant=T) == dict([C])  # order: B A C
        store.put(*D, tenant=T)
        assert held(store, A, B, C, D) == [True, False, True, True]


def test_reopening_sqlite_with_a_smaller_budget_evicts_the_oldest(tmp_path: Path) -> None:
    path = tmp_path / "chunks.db"
    with ChunkStore(path, max_bytes=3 * SIZE) as store:
        store.put_many(dict([A, B, C]), tenant=T)
    with ChunkStore(path, max_bytes=SIZE) as store:
        assert held(store, A, B, C) == [False, False, True]
        assert (store.count, store.total_bytes) == (1, SIZE)


def test_a_smaller_budget_holds_from_the_next_put_on(storage: Storage) -> None:
    """Redis is not asked anything on open (a replica starts while it is down): its first put evicts."""
    with storage.open(max_bytes=3 * SIZE) as store:
        store.put_many(dict([A, B, C]), tenant=T)
    with storage.open(max_bytes=SIZE) as store:
        store.put_many({}, tenant=T)
        assert held(store, A, B, C) == [False, False, True]
        assert (store.count, store.total_bytes) == (1, SIZE)


def test_a_budget_must_be_positive(storage: Storage) -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        storage.open(max_bytes=0)


# -- threads --------------------------------------------------------------------------------------


def test_concurrent_puts_and_gets_from_threads_keep_the_store_consistent(storage: Storage) -> None:
    pool = [chunk(f"chunk-{i}") for i in range(40)]
    budget = 20 * SIZE
    errors: list[BaseException] = []

    def worker(store: AnyChunkStore, seed: int) -> None:
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

    with storage.open(max_bytes=budget) as store:
        threads = [threading.Thread(target=worker, args=(store, seed)) for seed in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        count, total = store.count, store.total_bytes
        assert store.hits + store.misses > 0
    rows = storage.rows()
    assert (count, total) == (len(rows), sum(len(data) for _, data in rows))
    assert total <= budget
    assert all(digest(data) == d for d, data in rows)
