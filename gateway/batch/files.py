"""Files of the Batch API (uploaded inputs, produced outputs) and the Idempotency-Keys of create calls,
in the gateway's SQLite database; batch/store.py adds the batches to the same connection.

Invariants:
- An Idempotency-Key row is written in the transaction that creates its object, so two retries racing
  each other still create one object; a key names its object for KEY_TTL_S.
- A file's content never changes; deleting a file forgets the keys that name it.
- Files and batches belong to the tenant that created them (`owner`; a batch's output files to the
  batch's owner). A call given an owner sees only that owner's objects: another tenant's id is "not
  found", and lists hold only its own. `owner=None` is the runner's own access to everything.
  Idempotency-Keys are scoped by owner in the key itself (batch/routes.py), so one tenant's key
  never replays another's object.
- A file may expire (`expires_at`, NULL: never): from that second on every call acts as if it were
  deleted (get, content, delete, lists, an Idempotency-Key naming it), through `clock`, and sweep()
  deletes the expired rows so their space is reused (and handed back to the filesystem where the
  database was made with incremental auto-vacuum).

Thread-safe: one connection, one lock (as edge/chunk_store.py). The routes and the runner call it off the
event loop (asyncio.to_thread), so a slow disk stalls the Batch API, never the gateway's other routes.
Large contents are read and written in pieces (SQLite's incremental blob I/O), never whole in memory.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from gateway.encoding import encode
from shared.batch_protocol import FileObject
from shared.sql_page import newest_first
from shared.sqlite_store import ensure_columns, open_db, transaction
from shared.storage_faults import require_room

# the whole database: files and keys (here), batches and their requests (batch/store.py)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, purpose TEXT NOT NULL,
    object BLOB NOT NULL, content BLOB NOT NULL, owner TEXT NOT NULL DEFAULT 'default',
    expires_at INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, status TEXT NOT NULL,
    object BLOB NOT NULL, owner TEXT NOT NULL DEFAULT 'default', output_ttl_s INTEGER
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
# `WHERE id = ? {OWNED}` with (id, owner, owner): the row if it is the owner's, or any owner's for None
OWNED = "AND (? IS NULL OR owner = ?)"
# `... {LIVE}` with (now,): the file unless it has expired
LIVE = "AND (expires_at IS NULL OR expires_at > ?)"
# columns added since the first schema: a database made before them gets them (NULL, or the default)
_ADDED = {
    "files": {
        "owner": "TEXT NOT NULL DEFAULT 'default'",  # before tenants: everything is the default's
        "expires_at": "INTEGER",  # before expiry: files never expire
    },
    "batches": {"owner": "TEXT NOT NULL DEFAULT 'default'", "output_ttl_s": "INTEGER"},
}
KEY_TTL_S = 24 * 3600  # how long an Idempotency-Key names its object (as Stripe and OpenAI keep them)


@dataclass(frozen=True, slots=True)
class Idem:
    """An Idempotency-Key on a route, with the digest of the request it came with."""

    route: str
    key: str
    digest: bytes


@dataclass(frozen=True, slots=True)
class ContentRef:
    """A file's content in the database: its row and its size in bytes."""

    row: int
    size: int


class KeyReused:
    """The key already names a different request (the route answers 422)."""


KEY_REUSED = KeyReused()


def new_file(purpose: str, filename: str, size: int, ttl_s: int | None, now: int) -> FileObject:
    """A new file's object (`ttl_s`: its lifetime, None: until deleted), not yet stored."""
    return FileObject(
        id=f"file-{uuid.uuid4().hex[:24]}",
        bytes=size,
        created_at=now,
        filename=filename,
        purpose=purpose,
        expires_at=None if ttl_s is None else now + ttl_s,
    )


class FileStore:
    def __init__(
        self,
        path: Path | str,
        clock: Callable[[], float] = time.time,
        default_ttl_s: int | None = None,
        min_free_bytes: int = 0,
    ) -> None:
        """`clock`: seconds since the epoch, deciding what has expired; `default_ttl_s`: the lifetime of
        a file made without one (None: until deleted, as OpenAI keeps them); `min_free_bytes`: an
        upload that would leave less free on the disk is refused (the batches' results are not)."""
        self._path = Path(path)
        self._min_free = min_free_bytes
        self._clock = clock
        self._default_ttl_s = default_ttl_s
        self._lock = threading.Lock()
        # durable (synchronous=FULL): a commit is on disk before the client hears of it, so power loss
        # cannot roll back an acknowledged upload, create or cancel (NORMAL in WAL may lose the last
        # commits: work run twice). Incremental vacuum: sweep() can give the pages of expired files
        # back to the filesystem (on a database made since; it has no effect on an older one).
        self._db = open_db(path, durable=True, incremental_vacuum=True, store="batch")
        self._db.executescript(_SCHEMA)
        for table, columns in _ADDED.items():
            ensure_columns(self._db, table, columns)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock, transaction(self._db) as db:
            yield db

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
        self,
        purpose: str,
        filename: str,
        content: bytes,
        idem: Idem | None = None,
        ttl_s: int | None = None,
        *,
        owner: str,
    ) -> FileObject | KeyReused:
        """A new file expiring `ttl_s` after its creation (None: the store's default); StorageFault when
        the disk cannot take it (nothing is stored then)."""
        with self._tx() as db:
            replay = self._replay(db, idem)
            if isinstance(replay, KeyReused):
                return replay
            if replay is not None:
                found = self._file(db, replay)
                if found is not None:
                    return found
                # the key's file expired (not yet swept): the key goes with it, as with a deleted one
                db.execute("DELETE FROM idempotency WHERE object_id = ?", (replay,))
            require_room("batch", self._path, len(content), self._min_free)  # (not for a replay)
            f = self._insert_file(db, purpose, filename, content, ttl_s, owner)
            self._remember(db, idem, f.id)
            return f

    def _new_file(self, purpose: str, filename: str, size: int, ttl_s: int | None) -> FileObject:
        return new_file(purpose, filename, size, ttl_s or self._default_ttl_s, int(self._clock()))

    def _insert_file(
        self,
        db: sqlite3.Connection,
        purpose: str,
        filename: str,
        content: bytes,
        ttl_s: int | None,
        owner: str,
    ) -> FileObject:
        f = self._new_file(purpose, filename, len(content), ttl_s)
        db.execute(
            "INSERT INTO files (id, purpose, object, content, owner, expires_at) VALUES (?, ?, ?, ?, ?, ?)",
            (f.id, purpose, encode(f), content, owner, f.expires_at),
        )
        return f

    def _insert_sized_file(
        self, db: sqlite3.Connection, purpose: str, filename: str, size: int, ttl_s: int | None, owner: str
    ) -> tuple[FileObject, ContentRef]:
        """A new file of `size` zero bytes, for _write_content to fill."""
        f = self._new_file(purpose, filename, size, ttl_s)
        cur = db.execute(
            "INSERT INTO files (id, purpose, object, content, owner, expires_at) "
            "VALUES (?, ?, ?, zeroblob(?), ?, ?)",
            (f.id, purpose, encode(f), size, owner, f.expires_at),
        )
        return f, ContentRef(int(cur.lastrowid or 0), size)

    def _file(self, db: sqlite3.Connection, file_id: str) -> FileObject | None:
        row = db.execute(f"SELECT object FROM files WHERE id = ? {LIVE}", (file_id, self._clock())).fetchone()
        return None if row is None else msgspec.json.decode(row[0], type=FileObject)

    def get_file(self, file_id: str, owner: str | None = None) -> FileObject | None:
        row = self._one(
            f"SELECT object FROM files WHERE id = ? {OWNED} {LIVE}", file_id, owner, owner, self._clock()
        )
        return None if row is None else msgspec.json.decode(row[0], type=FileObject)

    def file_content(self, file_id: str) -> bytes | None:
        row = self._one(f"SELECT content FROM files WHERE id = ? {LIVE}", file_id, self._clock())
        return None if row is None else bytes(row[0])

    def content_ref(self, file_id: str, owner: str | None = None) -> ContentRef | None:
        """Where a file's content is, to read it in pieces (read_content); None if no such file."""
        row = self._one(
            f"SELECT seq, length(content) FROM files WHERE id = ? {OWNED} {LIVE}",
            file_id,
            owner,
            owner,
            self._clock(),
        )
        return None if row is None else ContentRef(int(row[0]), int(row[1]))

    def read_content(self, ref: ContentRef, offset: int, size: int) -> bytes | None:
        """Up to `size` bytes of the content at `offset`; None once the file is deleted."""
        with self._lock:
            try:
                with self._db.blobopen("files", "content", ref.row, readonly=True) as blob:
                    blob.seek(offset)
                    return blob.read(size)
            except sqlite3.OperationalError:  # no such row: deleted while it was read
                return None

    def _write_content(self, db: sqlite3.Connection, ref: ContentRef, pieces: Iterator[bytes]) -> None:
        """Fill a file made by _insert_sized_file piece by piece; the pieces add up to its size."""
        with self._db.guard(), db.blobopen("files", "content", ref.row) as blob:
            for piece in pieces:
                blob.write(piece)

    def list_files(
        self, limit: int, after: str | None, purpose: str | None, *, owner: str
    ) -> list[FileObject]:
        """Newest first, after the file `after` (a cursor); one more than `limit` tells there are more."""
        rows = self._page("files", limit, after, purpose, owner)
        return [msgspec.json.decode(r, type=FileObject) for r in rows]

    def delete_file(self, file_id: str, *, owner: str) -> bool:
        with self._tx() as db:
            found = db.execute(
                f"SELECT 1 FROM files WHERE id = ? AND owner = ? {LIVE}", (file_id, owner, self._clock())
            ).fetchone()
            if found is None:
                return False
            db.execute("DELETE FROM idempotency WHERE object_id = ?", (file_id,))
            return db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    def sweep(self) -> int:
        """Delete the files that have expired (with the keys naming them); how many went."""
        with self._tx() as db:
            now = self._clock()
            expired = "SELECT id FROM files WHERE expires_at <= ?"
            db.execute(f"DELETE FROM idempotency WHERE object_id IN ({expired})", (now,))
            gone = db.execute("DELETE FROM files WHERE expires_at <= ?", (now,)).rowcount
        if gone:
            with self._lock:  # the freed pages back to the filesystem (a no-op without auto-vacuum)
                # executescript: it steps the pragma to its end (execute() frees one page per step)
                self._db.executescript("PRAGMA incremental_vacuum;")
        return gone

    def _page(
        self, table: str, limit: int, after: str | None, purpose: str | None, owner: str
    ) -> list[bytes]:
        live_at = int(self._clock()) if table == "files" else None  # (batches do not expire)
        sql, args = newest_first(table, "object", limit, after, purpose, owner, live_at)
        with self._lock:
            rows = self._db.execute(sql, args).fetchall()
        return [bytes(r[0]) for r in rows]
