"""What the batch outbox (outbox.py) answers besides files and batches: the values for "does not
fit", "key reused", "not cancellable", "in use", and the work items the forwarder takes from it."""

from __future__ import annotations

from dataclasses import dataclass

from shared.batch_protocol import BatchCreateRequest

TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True, slots=True)
class OutboxFull:
    """The file does not fit under the bound (policy refuse, or larger than the whole bound)."""

    needed: int
    free: int


class KeyReused:
    """The app's Idempotency-Key already names a different request."""


KEY_REUSED = KeyReused()


@dataclass(frozen=True, slots=True)
class NotCancellable:
    """The batch has finished (not by a cancel): there is nothing left to cancel."""

    status: str


@dataclass(frozen=True, slots=True)
class FileInUse:
    """A batch the forwarder still has work on reads this file."""

    batch_id: str


@dataclass(frozen=True, slots=True)
class Pending:
    """A batch the forwarder still has work on, with what each step needs."""

    batch_id: str
    state: str
    request: BatchCreateRequest  # input_file_id is the local id
    idem_key: str
    file_remote_id: str | None
    remote_id: str | None
    cancel: bool  # the app cancelled it and the gateway has not been told yet


@dataclass(frozen=True, slots=True)
class Upload:
    filename: str
    purpose: str
    content: bytes
    idem_key: str
    left_s: int | None  # seconds until the file expires (> 0: an expired file is no Upload); None: never


@dataclass(frozen=True, slots=True)
class Fetched:
    """A result file downloaded from the gateway."""

    remote_id: str
    content: bytes
