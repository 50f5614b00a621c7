"""Opening one of our SQLite stores, the same way in every store: the directory made, WAL, a synchronous
level chosen by what losing a commit costs, a busy timeout, and columns added to an older database.

- durable=True: `synchronous=FULL`. In WAL a commit is fsynced before it returns, so power loss cannot
  roll back a write the client was told about (an upload, a created or cancelled batch, a revoked key).
- durable=False: `synchronous=NORMAL`. The WAL is fsynced only at checkpoints: power loss may drop the
  last commits (a crash of the process alone never does), the database stays consistent. Only for
  stores whose loss is recovered, such as caches (the gateway's chunk store, the agent's acked set).

Every connection turns what its disk refuses (full, read-only, damaged, failing) into the store's
StorageFault (shared/storage_faults.py), and an existing database is checked when it is opened
(`PRAGMA quick_check` up to QUICK_CHECK_MAX_BYTES, the header and schema beyond), so a damaged file
is reported at start, never used, and never replaced by an empty one.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import structlog

from shared.errors import CtxfuseError
from shared.storage_faults import StorageFault, fault_from, storage_guard

# how long a write waits for another connection's lock before "database is locked" (sqlite3's default)
log = structlog.get_logger("ctxfuse.storage")

BUSY_TIMEOUT_S = 5.0
# databases up to this size get a structural check when opened (a 128 MiB one of uploaded files took
# 40 ms on a 2-core EPYC, from the page cache; many small rows cost more per byte); larger ones have
# their header and schema read
QUICK_CHECK_MAX_BYTES = 256 << 20


class GuardedConnection(sqlite3.Connection):
    """A connection whose statements, and the reads of their rows, raise what the disk refuses as its
    store's StorageFault."""

    store: str
    path: Path

    def fault(self, exc: sqlite3.Error) -> BaseException:
        return fault_from(exc, self.store, self.path) or exc

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        try:
            return self.cursor(GuardedCursor).execute(sql, parameters)
        except sqlite3.Error as exc:
            raise self.fault(exc) from exc

    def executemany(self, sql: str, parameters: Any, /) -> sqlite3.Cursor:
        try:
            return self.cursor(GuardedCursor).executemany(sql, parameters)
        except sqlite3.Error as exc:
            raise self.fault(exc) from exc

    def executescript(self, script: str, /) -> sqlite3.Cursor:
        try:
            return super().executescript(script)
        except sqlite3.Error as exc:
            raise self.fault(exc) from exc

    def commit(self) -> None:
        try:
            super().commit()
        except sqlite3.Error as exc:
            raise self.fault(exc) from exc

    def __exit__(self, *exc_info: Any) -> Literal[False]:
        try:
            return super().__exit__(*exc_info)
        except sqlite3.Error as exc:
            raise self.fault(exc) from exc

    def guard(self) -> contextlib.AbstractContextManager[None]:
        """For what goes past the statements (a blob's writes): raise the disk's refusals as faults."""
        return storage_guard(self.store, self.path)


class GuardedCursor(sqlite3.Cursor):
    """A cursor whose rows read after the first (a page of a large result, read from a damaged part of
    the file) raise its connection's StorageFault as the statement itself would."""

    def _fault(self, exc: sqlite3.Error) -> BaseException:
        db = self.connection
        return db.fault(exc) if isinstance(db, GuardedConnection) else exc

    def fetchone(self) -> Any:
        try:
            return super().fetchone()
        except sqlite3.Error as exc:
            raise self._fault(exc) from exc

    def fetchmany(self, size: int | None = None) -> list[Any]:
        try:
            return super().fetchmany(self.arraysize if size is None else size)
        except sqlite3.Error as exc:
            raise self._fault(exc) from exc

    def fetchall(self) -> list[Any]:
        try:
            return super().fetchall()
        except sqlite3.Error as exc:
            raise self._fault(exc) from exc

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except sqlite3.Error as exc:
            raise self._fault(exc) from exc


def open_db(
    path: Path | str,
    *,
    durable: bool,
    isolation_level: Literal["DEFERRED", "IMMEDIATE", "EXCLUSIVE"] | None = None,
    incremental_vacuum: bool = False,
    busy_timeout_s: float = BUSY_TIMEOUT_S,
    store: str,
) -> GuardedConnection:
    """A connection to the database at `path` (its directory made), in WAL at the level `durable` asks.

    Any thread may use it (`check_same_thread=False`): each store guards its one connection with its
    own lock. `isolation_level` None (the default) is autocommit, the store opening its transactions
    itself (BEGIN IMMEDIATE); "DEFERRED" lets `with db:` open and commit them as sqlite3 does.
    `incremental_vacuum`: a new database hands freed pages back to the filesystem on `PRAGMA
    incremental_vacuum` (it has no effect on a database that already has tables). `store`: its name
    in faults and metrics (shared/storage_faults.py STORES).

    On a disk already full, WAL's shared-memory index (the -shm file, deleted when the last
    connection closed) cannot be made: the database is then opened in exclusive locking mode, which
    keeps that index in this process's memory, so a store still starts and reads (and writes once
    there is room) instead of a process that cannot start. The cost, logged: no other process can
    open that database until this one restarts (for the key store: `ctxfuse keys` waits)."""
    try:
        return _connect(Path(path), durable, isolation_level, incremental_vacuum, busy_timeout_s, store)
    except StorageFault as fault:
        if fault.kind != "full":
            raise
    db = _connect(Path(path), durable, isolation_level, incremental_vacuum, busy_timeout_s, store, True)
    log.warning("store_opened_exclusive", store=store, path=str(path), why="the disk is full")
    return db


def _connect(
    path: Path,
    durable: bool,
    isolation_level: Literal["DEFERRED", "IMMEDIATE", "EXCLUSIVE"] | None,
    incremental_vacuum: bool,
    busy_timeout_s: float,
    store: str,
    exclusive: bool = False,
) -> GuardedConnection:
    with storage_guard(store, path):
        path.parent.mkdir(parents=True, exist_ok=True)
        existing = path.exists() and path.stat().st_size > 0
        db = sqlite3.connect(
            path,
            timeout=busy_timeout_s,
            check_same_thread=False,
            isolation_level=isolation_level,
            factory=GuardedConnection,
        )
    if not isinstance(db, GuardedConnection):  # (for the type checker: the factory made it one)
        raise TypeError(type(db))
    db.store, db.path = store, path
    try:
        if exclusive:  # before the first access: SQLite then never makes the -shm file
            db.execute("PRAGMA locking_mode=EXCLUSIVE")
        if existing:
            check_intact(db)
        if incremental_vacuum and not existing:  # before WAL: once the file is written it is too late
            db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
    except BaseException:
        db.close()
        raise
    return db


def open_rebuildable(
    path: Path | str, *, store: str, isolation_level: Literal["DEFERRED"] | None = None
) -> GuardedConnection:
    """A cache's database (durable=False: every row can be made again, as the chunk store's and the
    agent's acknowledged set's): one found damaged is moved aside (set_aside) with a warning and an
    empty one takes its place. A store holding what a client was promised never comes here."""
    try:
        return open_db(path, durable=False, isolation_level=isolation_level, store=store)
    except StorageFault as fault:
        if fault.kind != "damaged":
            raise
        aside = set_aside(Path(path))
        log.warning(
            "damaged_cache_set_aside", store=store, detail=fault.operator_message, moved_to=str(aside)
        )
        return open_db(path, durable=False, isolation_level=isolation_level, store=store)


def set_aside(path: Path) -> Path:
    """Move a damaged database (with its -wal and -shm) to `<name>.damaged-<unix time>`, kept for a
    look or a `.recover`; the new name."""
    aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
    for suffix in ("-wal", "-shm", ""):
        part = path.with_name(path.name + suffix)
        if part.exists():
            part.rename(aside.with_name(aside.name + suffix))
    return aside


def check_intact(db: GuardedConnection) -> None:
    """Raise the store's "damaged" StorageFault if its database is not sound: a structural check of a
    database up to QUICK_CHECK_MAX_BYTES, the header and schema of a larger one."""
    small = db.path.stat().st_size <= QUICK_CHECK_MAX_BYTES
    row = db.execute("PRAGMA quick_check(1)" if small else "PRAGMA schema_version").fetchone()
    if small and row[0] != "ok":
        raise StorageFault(db.store, db.path, "damaged", f"quick_check: {row[0]}")


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT on an autocommit connection; on any error (the block's or the
    COMMIT's) the transaction is rolled back if SQLite has not already done so (it does on a full
    disk), so the connection is usable for the next one: no restart after a fault."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error, CtxfuseError):  # the first error is the one to see
                db.execute("ROLLBACK")
        raise


def ensure_columns(db: sqlite3.Connection, table: str, columns: Mapping[str, str]) -> None:
    """Add the `columns` (name: SQL type and default) that `table` lacks, so a database made before
    them gets them (NULL or the default in its old rows); a no-op once they are there. One write
    transaction: all are added or none, and a second opener waits, then finds them. `table` and the
    names are ours, never a client's (they are written into the SQL)."""
    with transaction(db):
        have = {str(r[1]) for r in db.execute(f"PRAGMA table_info({table})")}
        for name, kind in columns.items():
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
