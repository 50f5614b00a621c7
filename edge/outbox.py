"""The agent's batch outbox: files and batches accepted from apps, kept in SQLite until the gateway
has run them and their results are stored here. Apps see local ids; the gateway's ids are recorded
as the forwarder (forwarder.py) learns them.

A batch moves   local --(input file uploaded)--> file_uploaded --(batch created)--> batch_created
                      --(results fetched)--> completed

A cancel from the app is cancelled here at once while the batch is local or file_uploaded (the
gateway has nothing to run); a created batch gets `cancel_at`, reads "cancelling", and the forwarder
sends the cancel (cancel_sent) when the link is up, then fetches the gateway's outcome as usual. If
the gateway created the batch while the app cancelled it here, the create is recorded (remote_id)
on the cancelled row and the forwarder sends the cancel after all. One gap remains: a create that
reached the gateway but whose answer was lost in a crash is unknown here, so cancelling that batch
before the forwarder's next create (which would return it) leaves it to run there unseen.

Invariants that make a kill -9 at any moment lose nothing and duplicate nothing:
- a file or batch is accepted in one transaction that also stores the Idempotency-Key the forwarder
  will send for it, so every retry of an upload or a create carries the same key and the gateway
  answers the first object it made;
- each state change is one transaction, written only after the gateway answered, so a crash repeats
  the last step (which the key makes harmless) and never skips one;
- a result file is stored under the gateway's file id (unique), in the same transaction that
  completes the batch.

One agent per state dir: the outbox takes the dir's lock (shared/dir_lock.py) before it opens the
database, so a second agent over it refuses to start (DirInUse) rather than forward everything twice.

The outbox is bounded in stored file bytes. When an app's file does not fit, the policy either
refuses it (`OutboxFull`) or drops the oldest batches, with their files, until it fits.

Files expire as on the gateway (gateway/batch/files.py): an upload's `expires_after`, a batch's
`output_expires_after` for the result files fetched for it (anchored at their arrival here). From the
second `clock` reaches `expires_at` the file is gone: every call that reads or writes files first
deletes the expired ones (_sweep), so no read can see one, its space is free again, and a batch that
still needed it to reach the gateway fails there as `invalid_file`, as the gateway's would.

A write the disk refuses raises the outbox's StorageFault (shared/storage_faults.py), rolled back:
the next works once there is room. An upload that would leave under `min_free_bytes` free is refused
first (that room is the forwarder's: its steps, the results it fetches). A damaged database: refused.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

import msgspec

from shared.batch_protocol import Batch, BatchCreateRequest, BatchError, BatchErrors, ExpiresAfter, FileObject
from shared.dir_lock import DirInUse, HeldBy, lock_dir
from shared.sql_page import newest_first
from shared.sqlite_store import transaction
from shared.storage_faults import require_room

from .config import FullPolicy
from .outbox_tables import drop_oldest, new_id, open_outbox, read_batch, read_file, used_bytes
from .outbox_values import (
    KEY_REUSED,
    Fetched,
    FileInUse,
    KeyReused,
    NotCancellable,
    OutboxFull,
    Pending,
    Upload,
)

T = TypeVar("T")


class Outbox:
    def __init__(
        self,
        path: Path,
        max_bytes: int,
        policy: FullPolicy,
        clock: Callable[[], float] = time.time,
        min_free_bytes: int = 0,
    ) -> None:
        """`clock`: seconds since the epoch, stamping what is made and deciding what has expired;
        `min_free_bytes`: the free space on its disk an upload may not take (a "full" StorageFault)."""
        lock = lock_dir(path.parent, "ctxfuse edge outbox")  # two agents would forward twice
        if isinstance(lock, HeldBy):
            raise DirInUse(lock, "agent state dir (--state-dir)")
        self._dir_lock = lock
        try:
            self._db = open_outbox(path)
        except BaseException:  # (damaged, unwritable: the dir is not held by an outbox never opened)
            lock.release()
            raise
        self.path = path
        self.clock = clock
        self._lock = threading.Lock()
        self.max_bytes = max_bytes
        self.policy = policy
        self.min_free_bytes = min_free_bytes

    # -- what apps do -----------------------------------------------------------------------------

    def put_file(
        self,
        filename: str,
        purpose: str,
        content: bytes,
        app_key: str | None,
        digest: bytes,
        ttl_s: int | None = None,
    ) -> FileObject | OutboxFull | KeyReused:
        """A new file expiring `ttl_s` after its creation (None: kept until deleted)."""
        with self._lock, self._tx():
            now = self._sweep()  # an expired file frees its space, and its key names nothing
            if app_key is not None:
                row = self._db.execute("SELECT id, app_digest FROM files WHERE app_key = ?", (app_key,))
                found = row.fetchone()
                if found is not None:
                    return self._known(self._file(found[0])) if bytes(found[1]) == digest else KEY_REUSED
            require_room("outbox", self.path, len(content), self.min_free_bytes)  # (not for a replay)
            full = self._make_room(len(content))
            if full is not None:
                return full
            file_id = new_id("file-")
            expires_at = None if ttl_s is None else now + ttl_s
            self._db.execute(
                "INSERT INTO files (id, filename, purpose, created_at, content, idem_key, app_key,"
                " app_digest, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (file_id, filename, purpose, now, content, uuid.uuid4().hex, app_key, digest, expires_at),
            )
            return self._known(self._file(file_id))

    def create_batch(self, req: BatchCreateRequest, app_key: str | None, digest: bytes) -> Batch | KeyReused:
        with self._lock, self._tx():
            if app_key is not None:
                found = self._db.execute(
                    "SELECT id, app_digest FROM batches WHERE app_key = ?", (app_key,)
                ).fetchone()
                if found is not None:
                    return self._known(self._batch(found[0])) if bytes(found[1]) == digest else KEY_REUSED
            batch_id = new_id("batch_")
            self._db.execute(
                "INSERT INTO batches (id, request, created_at, idem_key, state, app_key, app_digest)"
                " VALUES (?, ?, ?, ?, 'local', ?, ?)",
                (batch_id, msgspec.json.encode(req), self._now(), uuid.uuid4().hex, app_key, digest),
            )
            return self._known(self._batch(batch_id))

    def get_file(self, file_id: str) -> FileObject | None:
        with self._lock:
            self._sweep()
            return self._file(file_id)

    def file_content(self, file_id: str) -> bytes | None:
        with self._lock:
            self._sweep()
            row = self._db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else bytes(row[0])

    def get_batch(self, batch_id: str) -> Batch | None:
        with self._lock:
            return self._batch(batch_id)

    def used_bytes(self) -> int:
        with self._lock:
            return used_bytes(self._db)

    def list_batches(self, limit: int, after: str | None) -> list[Batch]:
        """Newest first, after the batch `after` (a cursor); one more than `limit` tells there are more."""
        with self._lock:
            ids = self._page("batches", limit, after, None)
            return [b for i in ids if (b := self._batch(i)) is not None]

    def list_files(self, limit: int, after: str | None, purpose: str | None) -> list[FileObject]:
        with self._lock:
            self._sweep()  # before paging, so a page holds `limit` live files when there are that many
            ids = self._page("files", limit, after, purpose)
            return [f for i in ids if (f := self._file(i)) is not None]

    def delete_file(self, file_id: str) -> bool | FileInUse:
        """Forget a file; False if there is none. An input the forwarder still needs stays."""
        with self._lock, self._tx():
            self._sweep()
            user = self._db.execute(
                "SELECT id FROM batches WHERE state != 'completed'"
                " AND json_extract(request, '$.input_file_id') = ? ORDER BY seq LIMIT 1",
                (file_id,),
            ).fetchone()
            if user is not None:
                return FileInUse(user[0])
            return self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    def cancel(self, batch_id: str) -> Batch | NotCancellable | None:
        """Cancel here at once if the gateway has nothing yet, else mark it for the forwarder."""
        now = self._now()
        with self._lock, self._tx():
            row = self._db.execute("SELECT state FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is None:
                return None
            if row[0] in ("local", "file_uploaded"):
                local = self._known(self._batch(batch_id))
                done = msgspec.structs.replace(local, status="cancelled", cancelling_at=now, cancelled_at=now)
                self._db.execute(
                    "UPDATE batches SET state = 'completed', remote = ?, cancel_at = ?, cancel_sent = 1"
                    " WHERE id = ?",
                    (msgspec.json.encode(done), now, batch_id),
                )
            elif row[0] == "batch_created":
                self._db.execute(
                    "UPDATE batches SET cancel_at = COALESCE(cancel_at, ?) WHERE id = ?", (now, batch_id)
                )
            batch = self._known(self._batch(batch_id))
            if batch.status not in ("cancelling", "cancelled"):
                return NotCancellable(batch.status)
            return batch

    # -- what the forwarder does ------------------------------------------------------------------

    def pending(self) -> list[Pending]:
        with self._lock:
            rows = self._db.execute(
                "SELECT b.id, b.state, b.request, b.idem_key, f.remote_id, b.remote_id,"
                " b.cancel_at IS NOT NULL AND b.cancel_sent = 0 FROM batches b"
                " LEFT JOIN files f ON f.id = json_extract(b.request, '$.input_file_id')"
                " WHERE b.state != 'completed'"
                " OR (b.cancel_at IS NOT NULL AND b.cancel_sent = 0 AND b.remote_id IS NOT NULL)"
                " ORDER BY b.seq"
            ).fetchall()
        return [
            Pending(
                r[0], r[1], msgspec.json.decode(r[2], type=BatchCreateRequest), r[3], r[4], r[5], bool(r[6])
            )
            for r in rows
        ]

    def state_of(self, batch_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT state FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return None if row is None else str(row[0])

    def upload_of(self, file_id: str) -> Upload | None:
        """What the forwarder sends for a file, with the lifetime it has left now; None once it is
        gone (deleted or expired)."""
        with self._lock:
            now = self._sweep()
            row = self._db.execute(
                "SELECT filename, purpose, content, idem_key, expires_at FROM files WHERE id = ?", (file_id,)
            ).fetchone()
        if row is None:
            return None
        left_s = None if row[4] is None else row[4] - now
        return Upload(row[0], row[1], bytes(row[2]), row[3], left_s)

    def remote_file_id(self, file_id: str) -> str | None:
        with self._lock:
            self._sweep()
            row = self._db.execute("SELECT remote_id FROM files WHERE id = ?", (file_id,)).fetchone()
        return None if row is None else row[0]

    def file_uploaded(self, batch_id: str, file_id: str, remote_file_id: str) -> None:
        with self._lock, self._tx():
            self._db.execute("UPDATE files SET remote_id = ? WHERE id = ?", (remote_file_id, file_id))
            self._db.execute(
                "UPDATE batches SET state = 'file_uploaded' WHERE id = ? AND state = 'local'", (batch_id,)
            )

    def batch_created(self, batch_id: str, remote: Batch) -> bool:
        """Record the gateway's batch; False if the app cancelled it here meanwhile (it stays
        cancelled here, and the recorded remote_id makes the forwarder cancel it there too)."""
        with self._lock, self._tx():
            moved = self._db.execute(
                "UPDATE batches SET state = 'batch_created', remote_id = ?, remote = ?"
                " WHERE id = ? AND state IN ('local', 'file_uploaded')",
                (remote.id, msgspec.json.encode(remote), batch_id),
            ).rowcount
            if not moved:
                self._db.execute(
                    "UPDATE batches SET remote_id = ?, cancel_sent = 0"
                    " WHERE id = ? AND cancel_at IS NOT NULL",
                    (remote.id, batch_id),
                )
            return moved > 0

    def cancel_sent(self, batch_id: str, remote: Batch | None) -> None:
        """The gateway took the cancel (`remote`: its batch now) or had nothing left to cancel."""
        with self._lock, self._tx():
            self._db.execute("UPDATE batches SET cancel_sent = 1 WHERE id = ?", (batch_id,))
            if remote is not None:
                self._db.execute(
                    "UPDATE batches SET remote = ? WHERE id = ? AND state = 'batch_created'",
                    (msgspec.json.encode(remote), batch_id),
                )

    def observe(self, batch_id: str, remote: Batch) -> None:
        with self._lock, self._tx():
            self._db.execute(
                "UPDATE batches SET remote = ? WHERE id = ?", (msgspec.json.encode(remote), batch_id)
            )

    def complete(self, batch_id: str, remote: Batch, output: Fetched | None, error: Fetched | None) -> None:
        """Store the results and finish the batch, all or nothing."""
        with self._lock, self._tx():
            ttl_s = self._output_ttl(batch_id)
            ids = [self._put_result(f, ttl_s) if f is not None else None for f in (output, error)]
            self._db.execute(
                "UPDATE batches SET state = 'completed', remote = ?, output_file_id = ?, error_file_id = ?"
                " WHERE id = ?",
                (msgspec.json.encode(remote), ids[0], ids[1], batch_id),
            )

    def fail(self, batch_id: str, code: str, message: str) -> None:
        """The gateway refused the batch (not a link failure): it ends here, failed, with the reason."""
        now = self._now()
        with self._lock:
            batch = self._batch(batch_id)
        if batch is None:
            return
        errors = BatchErrors(data=[BatchError(code=code, message=message)])
        failed = msgspec.structs.replace(batch, status="failed", failed_at=now, errors=errors)
        self.complete(batch_id, failed, None, None)

    # -- inside the lock ----------------------------------------------------------------------------

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        return transaction(self._db)

    def _now(self) -> int:
        return int(self.clock())

    def _sweep(self) -> int:
        """Delete the files expired by now; now. (The lock is held; inside a transaction or not.)"""
        now = self._now()
        self._db.execute("DELETE FROM files WHERE expires_at <= ?", (now,))
        return now

    def _page(self, table: str, limit: int, after: str | None, purpose: str | None) -> list[str]:
        """Ids newest first after the cursor `after`, `limit` + 1 of them (as the gateway pages)."""
        sql, args = newest_first(table, "id", limit, after, purpose)
        return [str(r[0]) for r in self._db.execute(sql, args).fetchall()]

    def _make_room(self, needed: int) -> OutboxFull | None:
        used = used_bytes(self._db)
        while used + needed > self.max_bytes:
            if self.policy == "refuse" or needed > self.max_bytes or not drop_oldest(self._db):
                return OutboxFull(needed=needed, free=max(0, self.max_bytes - used))
            used = used_bytes(self._db)
        return None

    def _output_ttl(self, batch_id: str) -> int | None:
        """The lifetime the app gave the batch's result files (`output_expires_after`), if any."""
        row = self._db.execute("SELECT request FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            return None
        expiry = msgspec.json.decode(row[0], type=BatchCreateRequest).output_expires_after
        return expiry.seconds if isinstance(expiry, ExpiresAfter) else None

    def _put_result(self, fetched: Fetched, ttl_s: int | None) -> str:
        """Store a result file (once per gateway file id), expiring `ttl_s` after it arrived here."""
        now = self._now()
        self._db.execute(
            "INSERT OR IGNORE INTO files (id, filename, purpose, created_at, content, idem_key, remote_id,"
            " expires_at) VALUES (?, ?, 'batch_output', ?, ?, '', ?, ?)",
            (
                new_id("file-"),
                f"{fetched.remote_id}.jsonl",
                now,
                fetched.content,
                fetched.remote_id,
                None if ttl_s is None else now + ttl_s,
            ),
        )
        row = self._db.execute("SELECT id FROM files WHERE remote_id = ?", (fetched.remote_id,)).fetchone()
        return str(row[0])

    @staticmethod
    def _known(obj: T | None) -> T:
        if obj is None:  # rows read back inside the transaction that wrote them
            raise LookupError("a row written in this transaction is missing")
        return obj

    def _file(self, file_id: str) -> FileObject | None:
        return read_file(self._db, file_id)

    def _batch(self, batch_id: str) -> Batch | None:
        return read_batch(self._db, batch_id)

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._dir_lock.release()
