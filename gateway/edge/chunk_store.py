"""The gateway's store of the chunks edge agents sent: content-addressed, in SQLite, bounded in bytes,
and answered per tenant.

Each chunk's bytes are stored once, but a tenant holds a chunk only once one of its own devices has
sent those bytes (table chunk_owners). Every read takes the caller's tenant and sees only that
tenant's chunks: a chunk another tenant sent is "missing", so a device can neither learn that some
other tenant holds a given text (the 409's list of missing digests) nor use a chunk it never had the
bytes of. Chunks stored before owners were recorded belong to no tenant: each is sent again once.

A chunk is kept under its digest (shared/chunking.py) until the store is over its byte budget and
the chunk is the least recently used. The file persists, so a restart keeps every chunk and its
place in the LRU order (WAL with synchronous=NORMAL: a crashed process loses nothing; a power cut
may lose the last commits, which agents re-send when told they are missing).

Invariants:
- Every row's data hashes to its digest: puts are verified before anything is written.
- `last_used` values are distinct ticks of one counter that resumes after the largest stored tick
  on open, so the LRU order is exact, survives restarts and ignores the wall clock.
- `total_bytes` and `count` equal SUM(size) and COUNT(*) of the chunks table (bytes counted once
  however many tenants hold them); an evicted chunk is evicted for every tenant.
- Every chunk_owners row names a stored chunk.
- Eviction runs only at the end of a put (and on open, if the budget shrank), after the call has
  stored its chunks and touched the ones it names, and never removes those: a request's chunks
  outlive the call that brings them, even if they alone exceed the budget (the store is then over
  budget until a later put). Being the newest, they are also the last that another request's put
  would evict before this request's get_many reads them.

Thread-safe: one connection, one lock; calls are short and the gateway may make them from any thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from shared.chunking import digest as chunk_digest
from shared.compression import ChunkError
from shared.sqlite_store import open_rebuildable, transaction
from shared.storage_faults import StorageFault

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chunks (
    digest BLOB PRIMARY KEY,
    data BLOB NOT NULL,
    size INTEGER NOT NULL,
    last_used INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_by_last_used ON chunks (last_used);
CREATE TABLE IF NOT EXISTS chunk_owners (
    tenant TEXT NOT NULL,
    digest BLOB NOT NULL,
    PRIMARY KEY (tenant, digest)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS chunk_owners_by_digest ON chunk_owners (digest);
"""
# the chunks among a query's rows that the tenant (the first parameter) holds
_OWNED = "digest IN (SELECT digest FROM chunk_owners WHERE tenant = ?)"
_BATCH = 500  # digests per IN (...) query, well under SQLite's bound on bound parameters


class ChunkStore:
    def __init__(self, path: Path | str, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        # Autocommit mode: transactions are opened explicitly (BEGIN IMMEDIATE) in _transaction.
        # Not durable (synchronous=NORMAL): a chunk lost to power loss is only a cache miss. The edge
        # link answers a request naming it with 409 and the missing digests, the agent re-sends them
        # (edge/acked.py is a hint it then forgets), and no request is run or acknowledged on a chunk
        # the store lacks.
        self._db = open_rebuildable(path, store="chunks")
        self._db.executescript(_SCHEMA)
        self.hits = 0  # chunks found by missing() and get_many()
        self.misses = 0  # chunks not found by them
        self.bytes_read = 0  # chunk bytes get_many() has returned: what expanding requests materialized
        self._load_totals()
        (clock,) = self._db.execute("SELECT COALESCE(MAX(last_used), 0) FROM chunks").fetchone()
        self._clock: int = clock
        with self._lock, self._transaction():
            self._evict(keep=set())  # the budget may have shrunk since the file was written

    # -- reads ----------------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    @property
    def count(self) -> int:
        return self._count

    def missing(self, digests: Sequence[bytes], *, tenant: str) -> list[bytes]:
        """The digests `tenant` does not hold, in request order, each once. Does not touch the LRU
        order."""
        wanted = _unique(digests)
        with self._lock:
            present = {row[0] for row in self._select("SELECT digest FROM chunks", wanted, tenant)}
            self._count_lookups(len(present), len(wanted))
        return [d for d in wanted if d not in present]

    def sizes(self, digests: Sequence[bytes], *, tenant: str) -> dict[bytes, int]:
        """The byte size of each chunk `tenant` holds among `digests` (others are left out), read
        without its bytes: an edge request's expanded size is bounded before any chunk is read.
        Neither touches the LRU order nor counts as a lookup (get_many that follows does both)."""
        with self._lock:
            rows = self._select("SELECT digest, size FROM chunks", _unique(digests), tenant)
            return {d: size for d, size in rows}

    def get_many(self, digests: Sequence[bytes], *, tenant: str) -> dict[bytes, bytes]:
        """The chunks `tenant` holds among `digests` (others are left out), made most recently used.

        Touched in request order, so the first named is the first of them to be evicted later.
        """
        wanted = _unique(digests)
        with self._lock:
            found = {d: data for d, data in self._select("SELECT digest, data FROM chunks", wanted, tenant)}
            self._count_lookups(len(found), len(wanted))
            self.bytes_read += sum(len(data) for data in found.values())
            # the LRU order is only a hint: a disk too full to record it never keeps a request from
            # the chunks the store holds (the lock is held: nothing is evicted in between)
            with contextlib.suppress(StorageFault), self._transaction():
                self._touch((d for d in wanted if d in found), tenant)
        return found

    # -- writes ---------------------------------------------------------------------------------

    def put(self, digest: bytes, data: bytes, *, tenant: str) -> None:
        self.put_many({digest: data}, tenant=tenant)

    def put_many(self, items: Mapping[bytes, bytes], *, tenant: str, touch: Sequence[bytes] = ()) -> None:
        """Store `items` (digest -> bytes) for `tenant` in one transaction, then evict down to the
        budget.

        `touch` names chunks the same request uses that `tenant` may already hold: they are made
        most recently used as well, and like `items` are kept from this call's eviction. Storing a
        chunk that is already there (for any tenant) stores no bytes again: it only becomes the
        tenant's and is touched. Raises ChunkError, storing nothing, if any bytes do not match their
        digest.

        A request is served by `put_many(its_new_chunks, touch=all_its_digests)`, then
        `get_many(all_its_digests)`: whatever get_many leaves out is what the 409 names.
        """
        for d, data in items.items():
            if chunk_digest(data) != d:
                raise ChunkError(f"chunk {d.hex()} does not match the digest of its {len(data)} bytes")
        with self._lock, self._transaction():
            for d, data in items.items():
                self._insert(d, data, tenant)
            self._touch(_unique(touch), tenant)
            self._evict(keep={*items, *touch})

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> ChunkStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals (called with the lock held) --------------------------------------------------

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        try:
            with transaction(self._db):
                yield
        except BaseException:
            self._load_totals()  # undo what the failed call counted
            raise

    def _load_totals(self) -> None:
        count, total = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM chunks").fetchone()
        self._count: int = count
        self._total_bytes: int = total

    def _select(self, query: str, digests: list[bytes], tenant: str) -> Iterator[tuple[Any, ...]]:
        """Rows of `query` over those of `digests` that `tenant` holds, in batches."""
        for lo in range(0, len(digests), _BATCH):
            batch = digests[lo : lo + _BATCH]
            marks = ",".join("?" * len(batch))
            yield from self._db.execute(f"{query} WHERE {_OWNED} AND digest IN ({marks})", [tenant, *batch])

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _insert(self, digest: bytes, data: bytes, tenant: str) -> None:
        inserted = self._db.execute(
            "INSERT OR IGNORE INTO chunks (digest, data, size, last_used) VALUES (?, ?, ?, ?)",
            (digest, data, len(data), self._tick()),
        ).rowcount
        self._db.execute(
            "INSERT OR IGNORE INTO chunk_owners (tenant, digest) VALUES (?, ?)", (tenant, digest)
        )
        if inserted:
            self._count += 1
            self._total_bytes += len(data)
        else:
            self._touch([digest], tenant)

    def _touch(self, digests: Iterable[bytes], tenant: str) -> None:
        # only the tenant's own chunks: naming another tenant's digest changes nothing
        self._db.executemany(
            f"UPDATE chunks SET last_used = ? WHERE digest = ? AND {_OWNED}",
            [(self._tick(), d, tenant) for d in digests],
        )

    def _evict(self, keep: set[bytes]) -> None:
        """Delete least recently used chunks not in `keep` until the store fits its budget."""
        excess = self._total_bytes - self._max_bytes
        if excess <= 0:
            return
        victims: list[tuple[bytes]] = []
        freed = 0
        rows = self._db.execute("SELECT digest, size FROM chunks ORDER BY last_used")
        for d, size in rows:
            if freed >= excess:
                break
            if d not in keep:
                victims.append((d,))
                freed += size
        rows.close()
        self._db.executemany("DELETE FROM chunks WHERE digest = ?", victims)
        self._db.executemany("DELETE FROM chunk_owners WHERE digest = ?", victims)
        self._count -= len(victims)
        self._total_bytes -= freed

    def _count_lookups(self, found: int, looked_up: int) -> None:
        self.hits += found
        self.misses += looked_up - found


def _unique(digests: Iterable[bytes]) -> list[bytes]:
    return list(dict.fromkeys(digests))
