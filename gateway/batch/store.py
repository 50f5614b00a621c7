"""Batches of the Batch API and their requests with results, beside the files (batch/files.py) in the
gateway's SQLite database.

Invariants:
- A request's result is written once (`ok` and `result` go from NULL to set, never back), so a batch
  resumed after a restart runs only what has no result, and no custom_id ever has two results.
- A batch's `request_counts` are read from its requests (total rows, rows ok, rows failed): they are
  current the moment a result is stored and cannot drift from it.
- Status changes that must not race (validating -> in_progress with the requests inserted, a cancel,
  the final files with the final status) are single transactions.
- Results go to the database one by one as they arrive; the output and error files are then written
  from them a page at a time, so no step holds a batch's results in memory.
- The output and error files expire `output_expires_after` after their own creation (kept as the
  batch's `output_ttl_s`; none given: the store's default file lifetime).
"""

from __future__ import annotations

import sqlite3
import time
import uuid

import msgspec

from gateway.batch.files import OWNED, FileStore, Idem, KeyReused
from gateway.batch.input import BatchItem
from gateway.encoding import encode
from shared.batch_protocol import (
    Batch,
    BatchCreateRequest,
    BatchErrors,
    BatchStatus,
    ExpiresAfter,
    FileObject,
)

ACTIVE: tuple[BatchStatus, ...] = ("validating", "in_progress", "finalizing", "cancelling")
WINDOW_S = {"24h": 24 * 3600}  # completion windows served
_PAGE = 64  # results read at a time while an output file is written


def new_batch(req: BatchCreateRequest, now: int) -> tuple[Batch, int | None]:
    """A new batch's object, not yet stored, and the lifetime of its output files (None: the store's
    default)."""
    b = Batch(
        id=f"batch_{uuid.uuid4().hex[:24]}",
        endpoint=req.endpoint,
        input_file_id=req.input_file_id,
        completion_window=req.completion_window,
        status="validating",
        created_at=now,
        expires_at=now + WINDOW_S[req.completion_window],
        metadata=req.metadata,
    )
    expiry = req.output_expires_after
    return b, expiry.seconds if isinstance(expiry, ExpiresAfter) else None


class BatchStore(FileStore):
    # -- batches ----------------------------------------------------------------------------------

    def create_batch(
        self, req: BatchCreateRequest, idem: Idem | None = None, *, owner: str
    ) -> Batch | KeyReused:
        now = int(time.time())
        with self._tx() as db:
            replay = self._replay(db, idem)
            if replay is not None:
                found = replay if isinstance(replay, KeyReused) else self._batch(db, replay)
                if found is not None:  # (batches are never deleted, so a key's batch is there)
                    return found
            b, ttl_s = new_batch(req, now)
            db.execute(
                "INSERT INTO batches (id, status, object, owner, output_ttl_s) VALUES (?, ?, ?, ?, ?)",
                (b.id, b.status, encode(b), owner, ttl_s),
            )
            self._remember(db, idem, b.id)
            return b

    def _batch(self, db: sqlite3.Connection, batch_id: str, owner: str | None = None) -> Batch | None:
        row = db.execute(
            f"SELECT object FROM batches WHERE id = ? {OWNED}", (batch_id, owner, owner)
        ).fetchone()
        if row is None:
            return None
        b = msgspec.json.decode(row[0], type=Batch)
        total, done, failed = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(ok = 1), 0), COALESCE(SUM(ok = 0), 0) FROM requests "
            "WHERE batch_id = ?",
            (batch_id,),
        ).fetchone()
        b.request_counts.total, b.request_counts.completed, b.request_counts.failed = total, done, failed
        return b

    def get_batch(self, batch_id: str, owner: str | None = None) -> Batch | None:
        with self._lock:
            return self._batch(self._db, batch_id, owner)

    def owner_of(self, batch_id: str) -> str:
        """The tenant that created the batch."""
        row = self._one("SELECT owner FROM batches WHERE id = ?", batch_id)
        if row is None:
            raise KeyError(batch_id)
        return str(row[0])

    def list_batches(self, limit: int, after: str | None, *, owner: str) -> list[Batch]:
        rows = self._page("batches", limit, after, None, owner)
        ids = [msgspec.json.decode(r, type=Batch).id for r in rows]
        with self._lock:
            return [b for i in ids if (b := self._batch(self._db, i)) is not None]

    def next_active(self) -> Batch | None:
        """The oldest batch the runner has work on."""
        ids = self.active_ids(1, frozenset())
        return self.get_batch(ids[0]) if ids else None

    def active_ids(self, limit: int, skip: frozenset[str]) -> list[str]:
        """Up to `limit` ids of batches the runner has work on, oldest first, leaving out `skip`."""
        marks = ",".join("?" * len(ACTIVE))
        with self._lock:
            rows = self._db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq", ACTIVE)
            ids = [str(r[0]) for r in rows]
        return [i for i in ids if i not in skip][:limit]

    def transition(
        self,
        batch_id: str,
        status: BatchStatus,
        *,
        only_from: tuple[BatchStatus, ...] = ACTIVE,
        owner: str | None = None,
        **fields: object,
    ) -> Batch | None:
        """Move the batch to `status` (stamping `<status>_at`) if it is in one of `only_from` (and
        `owner`'s, when given); None if not."""
        with self._tx() as db:
            if self._batch(db, batch_id, owner) is None:
                return None
            return self._transition(db, batch_id, status, only_from, fields)

    def _transition(
        self,
        db: sqlite3.Connection,
        batch_id: str,
        status: BatchStatus,
        only_from: tuple[BatchStatus, ...],
        fields: dict[str, object],
    ) -> Batch | None:
        b = self._batch(db, batch_id)
        if b is None or b.status not in only_from:
            return None
        b.status = status
        setattr(b, f"{status}_at", int(time.time()))
        for name, value in fields.items():
            setattr(b, name, value)
        db.execute("UPDATE batches SET status = ?, object = ? WHERE id = ?", (status, encode(b), batch_id))
        return b

    def fail_validation(self, batch_id: str, errors: BatchErrors) -> Batch | None:
        return self.transition(batch_id, "failed", only_from=("validating",), errors=errors)

    def start(self, batch_id: str, items: list[BatchItem]) -> Batch | None:
        """validating -> in_progress with the batch's requests stored, in one transaction."""
        with self._tx() as db:
            b = self._transition(db, batch_id, "in_progress", ("validating",), {})
            if b is not None:
                db.executemany(
                    "INSERT INTO requests (batch_id, line, custom_id, body) VALUES (?, ?, ?, ?)",
                    [(batch_id, i.line, i.custom_id, i.body) for i in items],
                )
            return b

    def pending(self, batch_id: str) -> list[BatchItem]:
        with self._lock:
            rows = self._db.execute(
                "SELECT line, custom_id, body FROM requests WHERE batch_id = ? AND ok IS NULL ORDER BY line",
                (batch_id,),
            ).fetchall()
        return [BatchItem(line, custom_id, bytes(body)) for line, custom_id, body in rows]

    def put_result(self, batch_id: str, line: int, ok: bool, result: bytes) -> bool:
        """Store a request's output line; False if it already had one (it is never overwritten)."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE requests SET ok = ?, result = ? WHERE batch_id = ? AND line = ? AND ok IS NULL",
                (int(ok), result, batch_id, line),
            )
            return cur.rowcount > 0

    def finish(self, batch_id: str, status: BatchStatus, errors: BatchErrors | None = None) -> Batch | None:
        """Write the output and error files from the stored results (in input order) and set the final
        status, in one transaction: a crash before it commits leaves the batch to finish again."""
        with self._tx() as db:
            fields: dict[str, object] = {} if errors is None else {"errors": errors}
            for ok, name in ((1, "output_file_id"), (0, "error_file_id")):
                f = self._results_file(db, batch_id, ok, f"{batch_id}_{name[:-8]}.jsonl")
                if f is not None:
                    fields[name] = f.id
            return self._transition(db, batch_id, status, ACTIVE, fields)

    def _results_file(
        self, db: sqlite3.Connection, batch_id: str, ok: int, filename: str
    ) -> FileObject | None:
        """A JSONL file of the batch's results that are `ok`, one per line in input order; None if none.
        The file is sized first, then filled a page of results at a time."""
        where = "FROM requests WHERE batch_id = ? AND ok = ?"
        count, size = db.execute(
            f"SELECT COUNT(*), COALESCE(SUM(length(result)), 0) {where}", (batch_id, ok)
        ).fetchone()
        if count == 0:
            return None
        owner, ttl_s = db.execute(
            "SELECT owner, output_ttl_s FROM batches WHERE id = ?", (batch_id,)
        ).fetchone()
        # + a newline each; the batch's owner owns its results
        f, ref = self._insert_sized_file(db, "batch_output", filename, size + count, ttl_s, str(owner))
        cursor = db.execute(f"SELECT result {where} ORDER BY line", (batch_id, ok))
        pages = iter(lambda: cursor.fetchmany(_PAGE), [])
        self._write_content(db, ref, (piece for page in pages for r in page for piece in (r[0], b"\n")))
        return f
