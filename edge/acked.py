"""Which chunks the gateway has acknowledged: a bounded, persisted set of digests (SQLite, least
recently used first out). It is a hint, never a promise: the gateway may have evicted a chunk since,
and then answers 409 with what it lacks, which the uplink sends.

Being a hint that the gateway's answers re-derive, it never fails an app's request over its disk:
what the disk refuses (full, read-only, failing, damaged) is counted and logged where it is raised
(ctxfuse_storage_errors_total{store="acked"}) and otherwise ignored; a digest not recorded is only a
chunk sent again. A database found damaged when the agent starts is moved aside, with its -wal and
-shm, as `acked.sqlite.damaged-<unix time>` (a warning names it), and an empty one is started: unlike
the outbox, it holds nothing an app was promised."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from pathlib import Path

from shared.sqlite_store import GuardedConnection, open_rebuildable
from shared.storage_faults import StorageFault


class AckedChunks:
    def __init__(self, path: Path, max_entries: int) -> None:
        self._db = _open(path)
        self._lock = threading.Lock()
        self._max = max_entries
        row = self._db.execute("SELECT COALESCE(MAX(used), 0), COUNT(*) FROM acked").fetchone()
        self._clock, self._count = int(row[0]), int(row[1])

    def known(self, digests: Iterable[bytes]) -> set[bytes]:
        """The digests recorded as held: fewer (none) when the disk refuses the read."""
        wanted = list(dict.fromkeys(digests))
        found: set[bytes] = set()
        with self._lock, contextlib.suppress(StorageFault):
            for start in range(0, len(wanted), 500):  # SQLite's bound on query parameters
                part = wanted[start : start + 500]
                marks = ",".join("?" * len(part))
                rows = self._db.execute(f"SELECT digest FROM acked WHERE digest IN ({marks})", part)
                found.update(bytes(r[0]) for r in rows)
        return found

    def add(self, digests: Iterable[bytes]) -> None:
        """Mark these held (and most recently used); the oldest go once over the bound. Nothing is
        recorded when the disk refuses the write (rolled back whole)."""
        rows = []
        for d in dict.fromkeys(digests):
            self._clock += 1
            rows.append((self._clock, d))
        if not rows:
            return
        with self._lock, contextlib.suppress(StorageFault):
            with self._db:  # (DEFERRED: `with` opens and commits the transaction, rolls back on error)
                inserted = self._db.executemany(
                    "INSERT OR IGNORE INTO acked (used, digest) VALUES (?, ?)", rows
                ).rowcount
                self._db.executemany("UPDATE acked SET used = ? WHERE digest = ?", rows)
                count = self._count + max(0, inserted)
                if count > self._max:
                    self._db.execute(
                        "DELETE FROM acked WHERE digest IN (SELECT digest FROM acked ORDER BY used LIMIT ?)",
                        (count - self._max,),
                    )
                    count = self._max
            self._count = count  # only once committed

    def forget(self, digests: Iterable[bytes]) -> None:
        """The gateway said it lacks these: stop believing it holds them. If the disk refuses, they
        stay, and the gateway's next 409 names them again."""
        with self._lock, contextlib.suppress(StorageFault):
            with self._db:
                deleted = self._db.executemany("DELETE FROM acked WHERE digest = ?", [(d,) for d in digests])
                count = self._count - max(0, deleted.rowcount)
            self._count = count

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM acked").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _open(path: Path) -> GuardedConnection:
    # not durable: digests lost to power loss are only chunks sent again. `with db:` opens and
    # commits the transactions (DEFERRED, sqlite3's default).
    db = open_rebuildable(path, isolation_level="DEFERRED", store="acked")  # damaged: set aside
    try:
        db.execute("CREATE TABLE IF NOT EXISTS acked (digest BLOB PRIMARY KEY, used INTEGER NOT NULL)")
        db.execute("CREATE INDEX IF NOT EXISTS acked_used ON acked (used)")
    except BaseException:
        db.close()
        raise
    return db
