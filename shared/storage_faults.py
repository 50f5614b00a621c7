"""What a full, read-only or damaged disk looks like to ctxfuse, decided in one place.

Every store (the gateway's SQLite databases, the agent's outbox, the CA's files) turns the errors of
its disk into one `StorageFault` naming the store and the kind of fault, so a client gets a status it
can act on (507 `insufficient_storage` with Retry-After when the disk is full, 503 when it is
read-only, damaged or failing), an operator gets a log line and `ctxfuse_storage_errors_total{store,
kind}`, and nothing reaches the catch-all 500.

The kinds, from SQLite's result codes and the OS's errno:
- full: SQLITE_FULL; ENOSPC, EDQUOT, EFBIG. Space freed makes the next write work: no restart.
- read_only: SQLITE_READONLY; EROFS, EACCES, EPERM (a mount turned read-only, or lost permissions).
- damaged: SQLITE_CORRUPT, SQLITE_NOTADB (a database that is not one any more).
- failing: SQLITE_IOERR, SQLITE_CANTOPEN; EIO (the device itself).

Counts are per process (several apps in one process share them, as tests do); each app's /metrics
reads them at scrape time. A fault is logged once per store and kind per LOG_EVERY_S, with how many
were left unlogged since.
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import structlog
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.errors import CtxfuseError

log = structlog.get_logger("ctxfuse.storage")

Kind = Literal["full", "read_only", "damaged", "failing"]

RETRY_AFTER_S = 30.0  # what a client is told to wait on a full disk (the OpenAI SDK honours up to 60 s)
LOG_EVERY_S = 60.0

# SQLite's primary result codes (the low byte of an extended code)
_SQLITE_KINDS: dict[int, Kind] = {
    13: "full",
    8: "read_only",
    11: "damaged",
    26: "damaged",
    10: "failing",
    14: "failing",
}
_ERRNO_KINDS: dict[int, Kind] = {
    errno.ENOSPC: "full",
    errno.EDQUOT: "full",
    errno.EFBIG: "full",
    errno.EROFS: "read_only",
    errno.EACCES: "read_only",
    errno.EPERM: "read_only",
    errno.EIO: "failing",
}
_CODES: dict[Kind, str] = {
    "full": "insufficient_storage",
    "read_only": "storage_read_only",
    "damaged": "storage_damaged",
    "failing": "storage_failing",
}
_WHAT: dict[Kind, str] = {
    "full": "has too little space left on its disk",
    "read_only": "cannot be written (read-only filesystem or missing permissions)",
    "damaged": "is damaged",
    "failing": "cannot be read or written (an I/O error)",
}
_FIX: dict[Kind, str] = {
    "full": "free space on that disk or give it a larger volume; writes work again as soon as there is room",
    "read_only": "make the directory writable by this process (or remount it read-write), then try again",
    "damaged": "restore it from a backup, or move it aside to start with an empty one (what it held is "
    "then lost; `sqlite3 FILE .recover` may save its rows); it is never replaced silently",
    "failing": "check the disk (dmesg, SMART) and the file's permissions",
}
# what each store is, in a client's words (no server path in a client's answer; the log has it)
STORES: dict[str, str] = {
    "batch": "Files and Batch API store",
    "keys": "API key store",
    "responses": "stored-response store (Responses API)",
    "chunks": "edge chunk store",
    "outbox": "agent's batch outbox",
    "acked": "agent's acknowledged-chunk record",
    "ca": "certificate authority's files",
    "data_dir": "data directory",
    "server": "storage",  # a fault no store named (gateway/errors.py's last resort)
}


def kind_of(exc: BaseException) -> Kind | None:
    """The storage fault `exc` is, or None when it is not one (a bug, a constraint, a busy lock)."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return None if code is None else _SQLITE_KINDS.get(code & 0xFF)
    if isinstance(exc, OSError) and exc.errno is not None:
        return _ERRNO_KINDS.get(exc.errno)
    return None


class StorageFault(CtxfuseError):
    """A store's disk refused a read or write: 507 when full (retry once space is freed), else 503.

    `message` is a client's (the store named, no path); `operator_message` adds the path and the fix
    (the log's, and the one line `ctxfuse` prints when a store cannot be opened at start)."""

    type = "server_error"

    def __init__(self, store: str, path: Path, kind: Kind, detail: str = "") -> None:
        what = STORES.get(store, store)
        done = "nothing was stored" if kind in ("full", "read_only") else "the request was not served"
        super().__init__(f"the server's {what} {_WHAT[kind]}; {done}: retry later", code=_CODES[kind])
        self.status = 507 if kind == "full" else 503
        self.retry_after_s = RETRY_AFTER_S
        self.store, self.path, self.kind = store, path, kind
        detail = " ".join(detail.split())  # one line (quick_check reports over several)
        why = f" ({detail})" if detail else ""
        self.operator_message = f"the {what} {path} {_WHAT[kind]}{why}: {_FIX[kind]}"


def fault_from(exc: BaseException, store: str, path: Path) -> StorageFault | None:
    """`exc` as the store's StorageFault (counted and logged), or None if it is not a storage fault."""
    if isinstance(exc, StorageFault):
        return exc
    kind = kind_of(exc)
    if kind is None:
        return None
    if kind == "failing":
        kind = _failing_as(path)
    fault = StorageFault(store, path, kind, str(exc))
    FAULTS.record(fault)
    return fault


def _failing_as(path: Path) -> Kind:
    """What an I/O error at `path` is once its directory is looked at: read-only (SQLite's "unable to
    open" where it cannot write), full (less than a page left: SQLite cannot size its -shm file), or
    failing indeed."""
    directory = path if path.is_dir() else path.parent
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY or not os.access(directory, os.W_OK):
            return "read_only"
        return "full" if shutil.disk_usage(directory).free < 4096 else "failing"
    except OSError:
        return "failing"


@contextmanager
def storage_guard(store: str, path: Path) -> Iterator[None]:
    """Raise what the block's disk refused as the store's StorageFault; other errors pass as they are."""
    try:
        yield
    except (sqlite3.Error, OSError) as exc:
        fault = fault_from(exc, store, path)
        if fault is None:
            raise
        raise fault from exc


class FaultCounts:
    """Faults seen in this process, per (store, kind); the log line for each, rate-limited."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._logged_at: dict[tuple[str, str], tuple[float, int]] = {}  # when, count then

    def record(self, fault: StorageFault) -> None:
        key = (fault.store, fault.kind)
        now = time.monotonic()
        with self._lock:
            count = self._counts[key] = self._counts.get(key, 0) + 1
            last = self._logged_at.get(key)
            if last is not None and now - last[0] < LOG_EVERY_S:
                return
            self._logged_at[key] = (now, count)
        unlogged = 0 if last is None else count - last[1] - 1
        log.error(
            "storage_fault",
            store=fault.store,
            kind=fault.kind,
            unlogged_since=unlogged,
            detail=fault.operator_message,
        )

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


FAULTS = FaultCounts()


class FaultCollector(Collector):
    """`ctxfuse_storage_errors_total{store, kind}` for an app's registry, read at scrape time."""

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "ctxfuse_storage_errors",
            "Reads or writes a store's disk refused, by store and kind",
            labels=["store", "kind"],
        )
        for (store, kind), count in sorted(FAULTS.counts().items()):
            family.add_metric([store, kind], count)
        yield family


def check_writable(directory: Path, store: str = "data_dir") -> None:
    """Refuse a directory this process cannot write (it is made if missing): an empty file is made and
    removed there, as every store will. Raises the StorageFault naming it; a full disk is not refused
    (what needs no disk is still served, and writes work again once there is room)."""
    probe = directory / f".ctxfuse-write-probe-{threading.get_ident()}"
    try:
        with storage_guard(store, directory):
            directory.mkdir(parents=True, exist_ok=True)
            probe.touch()
            probe.unlink()
    except StorageFault as fault:
        if fault.kind != "full":
            raise


def require_room(store: str, path: Path, needed: int, floor: int) -> None:
    """Refuse (the store's "full" fault) a write of `needed` bytes to the store at `path` that would
    leave less than `floor` bytes free on its disk: the floor is what the other writes on that disk
    keep (a batch's results, a key, an outbox's bookkeeping) when one kind of write (uploads) would
    fill it, as Elasticsearch's flood-stage watermark keeps the last space for what is under way."""
    if floor <= 0:
        return
    with storage_guard(store, path):
        free = shutil.disk_usage(path.parent).free
    if free - needed < floor:
        fault = StorageFault(store, path, "full", f"{needed} bytes to write, {free} free, {floor} kept free")
        FAULTS.record(fault)
        raise fault
