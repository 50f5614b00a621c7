"""Opening one of our SQLite stores, the same way in every store: the directory made, WAL, a synchronous
level chosen by what losing a commit costs, a busy timeout, and columns added to an older database.

- durable=True: `synchronous=FULL`. In WAL a commit is fsynced before it returns, so power loss cannot
  roll back a write the client was told about (an upload, a created or cancelled batch, a revoked key).
- durable=False: `synchronous=NORMAL`. The WAL is fsynced only at checkpoints: power loss may drop the
  last commits (a crash of the process alone never does), the database stays consistent. Only for
  stores whose loss is recovered, such as caches (the gateway's chunk store, the agent's acked set).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

# how long a write waits for another connection's lock before "database is locked" (sqlite3's default)
BUSY_TIMEOUT_S = 5.0


def open_db(
    path: Path | str,
    *,
    durable: bool,
    isolation_level: Literal["DEFERRED", "IMMEDIATE", "EXCLUSIVE"] | None = None,
    incremental_vacuum: bool = False,
    busy_timeout_s: float = BUSY_TIMEOUT_S,
) -> sqlite3.Connection:
    """A connection to the database at `path` (its directory made), in WAL at the level `durable` asks.

    Any thread may use it (`check_same_thread=False`): each store guards its one connection with its
    own lock. `isolation_level` None (the default) is autocommit, the store opening its transactions
    itself (BEGIN IMMEDIATE); "DEFERRED" lets `with db:` open and commit them as sqlite3 does.
    `incremental_vacuum`: a new database hands freed pages back to the filesystem on `PRAGMA
    incremental_vacuum` (it has no effect on a database that already has tables)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(
        path, timeout=busy_timeout_s, check_same_thread=False, isolation_level=isolation_level
    )
    try:
        if incremental_vacuum:  # before WAL: once the database file is written it is too late
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
    except BaseException:
        db.close()
        raise
    return db


def ensure_columns(db: sqlite3.Connection, table: str, columns: Mapping[str, str]) -> None:
    """Add the `columns` (name: SQL type and default) that `table` lacks, so a database made before
    them gets them (NULL or the default in its old rows); a no-op once they are there. One write
    transaction: all are added or none, and a second opener waits, then finds them. `table` and the
    names are ours, never a client's (they are written into the SQL)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        have = {str(r[1]) for r in db.execute(f"PRAGMA table_info({table})")}
        for name, kind in columns.items():
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
