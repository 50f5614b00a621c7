"""Files of the Batch API (uploaded inputs, produced outputs) and the Idempotency-Keys of create calls,
in the gateway's SQLite database; batch_store.py adds the batches to the same connection.

Invariants:
- An Idempotency-Key row is written in the transaction that creates its object, so two retries racing
  each other still create one object; a key names its object for KEY_TTL_S.
- A file's content never changes; deleting a file forgets the keys that name it.

Thread-safe: one connection, one lock (as chunk_store.py); large writes may run off the event loop.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from shared.batch_protocol import FileObject
from shared.sql_page import newest_first

from .encoding import encode

# the whole database: files and keys (here), batches and their requests (batch_store.py)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, purpose TEXT NOT NULL,
    object BLOB NOT NULL, content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, status TEXT NOT NULL,
    object BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL, body BLOB NOT NULL,
    ok INTEGER, result BLOB, PRIMARY KEY (batch_id, line)
);
CREATE TABLE IF NOT EXISTS idempotency (
    route TEXT NOT NULL, key TEXT NOT NULL, digest BLOB NOT NULL, object_id TEXT NOT NULL,
    created_at INTEGER NOT NULL, PRIMARY KEY (route, key)
);
"""
KEY_TTL_S = 24 * 3600  # how long an Idempotency-Key names its object (as Stripe and OpenAI keep them)


@dataclass(frozen=True, slots=True)
class Idem:
    """An Idempotency-Key on a route, with the digest of the request it came with."""

    route: str
    key: str
    digest: bytes


class KeyReused:
    """The key already names a different request (the route answers 422)."""


KEY_REUSED = KeyReused()


class FileStore:
    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _one(self, sql: str, *args: object) -> Any:
        """The first row of `sql` (a tuple of column values), or None."""
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    # -- idempotency ------------------------------------------------------------------------------

    def _replay(self, db: sqlite3.Connection, idem: Idem | None) -> str | KeyReused | None:
        """The object id the key already created, KEY_REUSED, or None (new key, or none)."""
        if idem is None:
            return None
        db.execute("DELETE FROM idempotency WHERE created_at < ?", (int(time.time()) - KEY_TTL_S,))
        row = db.execute(
            "SELECT digest, object_id FROM idempotency WHERE route = ? AND key = ?", (idem.route, idem.key)
        ).fetchone()
        if row is None:
            return None
        return str(row[1]) if bytes(row[0]) == idem.digest else KEY_REUSED

    def _remember(self, db: sqlite3.Connection, idem: Idem | None, object_id: str) -> None:
        if idem is not None:
            db.execute(
                "INSERT INTO idempotency VALUES (?, ?, ?, ?, ?)",
                (idem.route, idem.key, idem.digest, object_id, int(time.time())),
            )

    # -- files ------------------------------------------------------------------------------------

    def put_file(
        self, purpose: str, filename: str, content: bytes, idem: Idem | None = None
    ) -> FileObject | KeyReused:
        with self._tx() as db:
            replay = self._replay(db, idem)
            if replay is not None:
                return replay if isinstance(replay, KeyReused) else self._file(db, replay)
            f = self._insert_file(db, purpose, filename, content)
            self._remember(db, idem, f.id)
            return f

    def _insert_file(self, db: sqlite3.Connection, purpose: str, filename: str, content: bytes) -> FileObject:
        f = FileObject(
            id=f"file-{uuid.uuid4().hex[:24]}",
            bytes=len(content),
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        db.execute(
            "INSERT INTO files (id, purpose, object, content) VALUES (?, ?, ?, ?)",
            (f.id, purpose, encode(f), content),
        )
        return f

    def _file(self, db: sqlite3.Connection, file_id: str) -> FileObject:
        row = db.execute("SELECT object FROM files WHERE id = ?", (file_id,)).fetchone()
        return msgspec.json.decode(row[0], type=FileObject)

    def get_file(self, file_id: str) -> FileObject | None:
        row = self._one("SELECT object FROM files WHERE id = ?", file_id)
        return None if row is None else msgspec.json.decode(row[0], type=FileObject)

    def file_content(self, file_id: str) -> bytes | None:
        row = self._one("SELECT content FROM files WHERE id = ?", file_id)
        return None if row is None else bytes(row[0])

    def list_files(self, limit: int, after: str | None, purpose: str | None) -> list[FileObject]:
        """Newest first, after the file `after` (a cursor); one more than `limit` tells there are more."""
        rows = self._page("files", limit, after, purpose)
        return [msgspec.json.decode(r, type=FileObject) for r in rows]

    def delete_file(self, file_id: str) -> bool:
        with self._tx() as db:
            db.execute("DELETE FROM idempotency WHERE object_id = ?", (file_id,))
            return db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    def _page(self, table: str, limit: int, after: str | None, purpose: str | None) -> list[bytes]:
        sql, args = newest_first(table, "object", limit, after, purpose)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [bytes(r[0]) for r in rows]
