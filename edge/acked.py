"""Which chunks the gateway has acknowledged: a bounded, persisted set of digests (SQLite, least
recently used first out). It is a hint, never a promise: the gateway may have evicted a chunk since,
and then answers 409 with what it lacks, which the uplink sends."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

from shared.sqlite_store import open_db


class AckedChunks:
    def __init__(self, path: Path, max_entries: int) -> None:
        # not durable: digests lost to power loss are only chunks sent again. `with self._db:` opens
        # and commits the transactions (DEFERRED, sqlite3's default).
        self._db = open_db(path, durable=False, isolation_level="DEFERRED")
        self._db.execute("CREATE TABLE IF NOT EXISTS acked (digest BLOB PRIMARY KEY, used INTEGER NOT NULL)")
        self._db.execute("CREATE INDEX IF NOT EXISTS acked_used ON acked (used)")
        self._lock = threading.Lock()
        self._max = max_entries
        row = self._db.execute("SELECT COALESCE(MAX(used), 0), COUNT(*) FROM acked").fetchone()
        self._clock, self._count = int(row[0]), int(row[1])

    def known(self, digests: Iterable[bytes]) -> set[bytes]:
        wanted = list(dict.fromkeys(digests))
        found: set[bytes] = set()
        with self._lock:
            for start in range(0, len(wanted), 500):  # SQLite's bound on query parameters
                part = wanted[start : start + 500]
                marks = ",".join("?" * len(part))
                rows = self._db.execute(f"SELECT digest FROM acked WHERE digest IN ({marks})", part)
                found.update(bytes(r[0]) for r in rows)
        return found

    def add(self, digests: Iterable[bytes]) -> None:
        """Mark these held (and most recently used); the oldest go once over the bound."""
        rows = []
        for d in dict.fromkeys(digests):
            self._clock += 1
            rows.append((self._clock, d))
        if not rows:
            return
        with self._lock, self._db:
            inserted = self._db.executemany("INSERT OR IGNORE INTO acked (used, digest) VALUES (?, ?)", rows)
            self._count += max(0, inserted.rowcount)
            self._db.executemany("UPDATE acked SET used = ? WHERE digest = ?", rows)
            if self._count > self._max:
                self._db.execute(
                    "DELETE FROM acked WHERE digest IN (SELECT digest FROM acked ORDER BY used LIMIT ?)",
                    (self._count - self._max,),
                )
                self._count = self._max

    def forget(self, digests: Iterable[bytes]) -> None:
        """The gateway said it lacks these: stop believing it holds them."""
        with self._lock, self._db:
            deleted = self._db.executemany("DELETE FROM acked WHERE digest = ?", [(d,) for d in digests])
            self._count -= max(0, deleted.rowcount)

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM acked").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()
