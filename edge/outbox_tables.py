"""The outbox's tables (outbox.py): their schema, row readers and the writes that keep it bounded.
Every function runs with the outbox's lock held, on its one connection."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

import msgspec

from shared.batch_protocol import Batch, BatchCreateRequest, FileObject
from shared.sqlite_store import GuardedConnection, ensure_columns, open_db

from .outbox_values import TERMINAL

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    content BLOB NOT NULL,
    idem_key TEXT NOT NULL,   -- sent with the upload to the gateway
    remote_id TEXT UNIQUE,    -- the gateway's id: once uploaded (inputs) or where fetched from (results)
    app_key TEXT UNIQUE,      -- the app's Idempotency-Key, with a digest of its request
    app_digest BLOB,
    expires_at INTEGER        -- NULL: kept until deleted
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    request BLOB NOT NULL,    -- the app's BatchCreateRequest (JSON), input_file_id local
    created_at INTEGER NOT NULL,
    idem_key TEXT NOT NULL,
    state TEXT NOT NULL,      -- local | file_uploaded | batch_created | completed
    remote_id TEXT,
    remote BLOB,              -- the gateway's Batch as last seen (JSON)
    output_file_id TEXT,
    error_file_id TEXT,
    app_key TEXT UNIQUE,
    app_digest BLOB,
    cancel_at INTEGER,        -- when the app asked to cancel
    cancel_sent INTEGER NOT NULL DEFAULT 0  -- the gateway has the cancel (or had nothing to cancel)
);
"""
# columns an outbox written by an older agent lacks, added when it is opened
ADDED_COLUMNS = {
    "batches": {"cancel_at": "INTEGER", "cancel_sent": "INTEGER NOT NULL DEFAULT 0"},  # before cancels
    "files": {"expires_at": "INTEGER"},  # before expiry: files never expire
}


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def used_bytes(db: sqlite3.Connection) -> int:
    """The stored file bytes, the quantity the outbox is bounded in."""
    return int(db.execute("SELECT COALESCE(SUM(LENGTH(content)), 0) FROM files").fetchone()[0])


def drop_oldest(db: sqlite3.Connection) -> bool:
    """Drop the oldest batch and the files only it used (or, with no batch, the oldest file)."""
    row = db.execute(
        "SELECT id, json_extract(request, '$.input_file_id'), output_file_id, error_file_id"
        " FROM batches ORDER BY seq LIMIT 1"
    ).fetchone()
    if row is None:
        oldest = db.execute("SELECT id FROM files ORDER BY seq LIMIT 1").fetchone()
        if oldest is None:
            return False
        db.execute("DELETE FROM files WHERE id = ?", (oldest[0],))
        return True
    db.execute("DELETE FROM batches WHERE id = ?", (row[0],))
    for file_id in row[1:]:
        still_used = db.execute(
            "SELECT 1 FROM batches WHERE json_extract(request, '$.input_file_id') = ?", (file_id,)
        ).fetchone()
        if file_id is not None and still_used is None:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
    return True


def read_file(db: sqlite3.Connection, file_id: str) -> FileObject | None:
    row = db.execute(
        "SELECT id, LENGTH(content), created_at, filename, purpose, expires_at FROM files WHERE id = ?",
        (file_id,),
    ).fetchone()
    if row is None:
        return None
    return FileObject(
        id=row[0], bytes=row[1], created_at=row[2], filename=row[3], purpose=row[4], expires_at=row[5]
    )


def read_batch(db: sqlite3.Connection, batch_id: str) -> Batch | None:
    row = db.execute(
        "SELECT request, created_at, state, remote, output_file_id, error_file_id, cancel_at"
        " FROM batches WHERE id = ?",
        (batch_id,),
    ).fetchone()
    if row is None:
        return None
    req = msgspec.json.decode(row[0], type=BatchCreateRequest)
    local = Batch(
        id=batch_id,
        endpoint=req.endpoint,
        input_file_id=req.input_file_id,
        completion_window=req.completion_window,
        status="validating",  # until the gateway has it
        created_at=row[1],
        metadata=req.metadata,
    )
    if row[3] is None:
        return local
    remote = msgspec.json.decode(row[3], type=Batch)
    status, cancelling_at = remote.status, remote.cancelling_at
    if row[2] != "completed" and row[6] is not None:
        status, cancelling_at = "cancelling", cancelling_at or row[6]  # until the outcome is here
    elif row[2] != "completed" and status in TERMINAL:
        status = "finalizing"  # done there, results not yet here
    return msgspec.structs.replace(
        remote,
        id=local.id,
        input_file_id=local.input_file_id,
        created_at=local.created_at,
        metadata=local.metadata,
        status=status,
        cancelling_at=cancelling_at,
        output_file_id=row[4],
        error_file_id=row[5],
    )


def open_outbox(path: Path) -> GuardedConnection:
    """The outbox's database, its tables made or brought up to date (StorageFault: damaged, unwritable)."""
    db = open_db(path, durable=True, store="outbox")  # an accepted batch survives power loss too
    try:
        db.executescript(SCHEMA)
        for table, columns in ADDED_COLUMNS.items():  # an outbox written by an older agent
            ensure_columns(db, table, columns)
        db.execute("CREATE INDEX IF NOT EXISTS files_expiry ON files (expires_at)")
    except BaseException:
        db.close()
        raise
    return db
