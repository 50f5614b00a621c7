"""Opening a store: its directory made, WAL at the synchronous level its durability asks, a busy
timeout, and the columns of a newer schema added to an older database once."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from shared.sqlite_store import ensure_columns, open_db
from shared.storage_faults import StorageFault

from ..storage_rig import fill, make_room, small_fs


def pragma(db: sqlite3.Connection, name: str) -> object:
    return db.execute(f"PRAGMA {name}").fetchone()[0]


@pytest.mark.parametrize(("durable", "synchronous"), [(True, 2), (False, 1)])  # FULL, NORMAL
def test_a_store_opens_in_wal_at_its_durability_in_a_directory_made_for_it(
    tmp_path: Path, durable: bool, synchronous: int
) -> None:
    path = tmp_path / "not" / "yet" / "there.sqlite"
    db = open_db(path, durable=durable, store="batch")
    try:
        assert path.is_file()
        assert pragma(db, "journal_mode") == "wal"
        assert pragma(db, "synchronous") == synchronous
        assert pragma(db, "busy_timeout") == 5000  # ms: a writer waits for another's lock, then fails
        assert pragma(db, "auto_vacuum") == 0 and db.isolation_level is None  # autocommit
    finally:
        db.close()


def test_incremental_vacuum_is_set_on_a_new_database_and_the_isolation_level_is_kept(
    tmp_path: Path,
) -> None:
    db = open_db(
        tmp_path / "v.sqlite",
        durable=True,
        incremental_vacuum=True,
        isolation_level="DEFERRED",
        store="batch",
    )
    try:
        db.execute("CREATE TABLE t (x INTEGER)")
        assert pragma(db, "auto_vacuum") == 2  # INCREMENTAL, though the file is in WAL
        assert db.isolation_level == "DEFERRED"
        with db:  # sqlite3 opens the transaction and commits it
            db.execute("INSERT INTO t VALUES (1)")
            assert db.in_transaction
        assert not db.in_transaction
    finally:
        db.close()


def test_missing_columns_are_added_to_an_older_table_once(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as old:  # a database written before the columns existed
        old.execute("CREATE TABLE items (id TEXT PRIMARY KEY)")
        old.execute("INSERT INTO items VALUES ('a')")
    old.close()
    added = {"owner": "TEXT NOT NULL DEFAULT 'default'", "expires_at": "INTEGER"}
    db = open_db(path, durable=True, store="batch")
    try:
        ensure_columns(db, "items", added)
        columns = [r[1] for r in db.execute("PRAGMA table_info(items)")]
        assert columns == ["id", "owner", "expires_at"]
        assert db.execute("SELECT id, owner, expires_at FROM items").fetchall() == [("a", "default", None)]
        ensure_columns(db, "items", added)  # already there: nothing added, nothing refused
        assert [r[1] for r in db.execute("PRAGMA table_info(items)")] == columns
        assert not db.in_transaction
    finally:
        db.close()


def test_a_column_that_cannot_be_added_adds_none_of_them(tmp_path: Path) -> None:
    db = open_db(tmp_path / "t.sqlite", durable=True, store="batch")
    try:
        db.execute("CREATE TABLE items (id TEXT PRIMARY KEY)")
        db.execute("INSERT INTO items VALUES ('a')")
        # a NOT NULL column without a default cannot be added to a table with rows: the first, fine
        # one is rolled back too
        with pytest.raises(sqlite3.OperationalError):
            ensure_columns(db, "items", {"fine": "INTEGER", "bad": "TEXT NOT NULL"})
        assert [r[1] for r in db.execute("PRAGMA table_info(items)")] == ["id"]
        assert not db.in_transaction
    finally:
        db.close()


def test_a_database_on_a_disk_already_full_opens_reads_and_writes_once_there_is_room(tmp_path: Path) -> None:
    """Its -shm file (gone with the last connection) cannot be made on a full disk: it opens in
    exclusive locking mode instead of keeping the process from starting."""
    with small_fs(tmp_path / "fs", 1024) as d:
        db = open_db(d / "s.sqlite", durable=True, store="keys")
        db.execute("CREATE TABLE t (v TEXT)")
        db.execute("INSERT INTO t VALUES ('kept')")
        db.close()
        assert not (d / "s.sqlite-shm").exists()
        fill(d)
        db = open_db(d / "s.sqlite", durable=True, store="keys")
        try:
            assert db.execute("SELECT v FROM t").fetchall() == [("kept",)]
            with pytest.raises(StorageFault) as refused:
                db.execute("INSERT INTO t VALUES (?)", ("x" * 100_000,))
            assert refused.value.kind == "full"
            make_room(d)
            db.execute("INSERT INTO t VALUES ('after')")
            assert [r[0] for r in db.execute("SELECT v FROM t")] == ["kept", "after"]
        finally:
            db.close()
