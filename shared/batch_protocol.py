"""OpenAI's Files and Batch API wire types as msgspec Structs (the shapes of openai-python's `FileObject`,
`Batch`, their lists, and the lines of batch input and output files).

Requests decode strictly and refuse unknown fields, as in protocol.py (`metadata` stays free-form). A
batch input line keeps its `body` as the raw JSON bytes (`msgspec.Raw`), so a batch request is decoded
by the very code that decodes a live request's body.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# the bounds OpenAI documents for `expires_after.seconds` (a file's) and `output_expires_after.seconds`
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 30 * 24 * 3600

# -- files ------------------------------------------------------------------------------------


class FileObject(Struct, kw_only=True):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: Literal["file"] = "file"
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(Struct, kw_only=True):
    data: list[FileObject]
    object: Literal["list"] = "list"
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(Struct, kw_only=True):
    id: str
    deleted: bool = True
    object: Literal["file"] = "file"


class FileUpload(Struct, kw_only=True):
    """The multipart form of POST /v1/files, as documented (the route reads the form itself)."""

    file: bytes
    purpose: str


class ExpiresAfter(Struct, kw_only=True, forbid_unknown_fields=True):
    """When a file expires: `seconds` after its creation (the only anchor OpenAI offers)."""

    anchor: Literal["created_at"]
    seconds: int


# -- batches ----------------------------------------------------------------------------------


class BatchCreateRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    # the expiry of the batch's output and error files, anchored at their own creation; UNSET (not
    # None) leaves it out of the encoded request, so Idempotency-Key digests from before it still match
    output_expires_after: ExpiresAfter | msgspec.UnsetType = msgspec.UNSET


class BatchRequestCounts(Struct, kw_only=True):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(Struct, kw_only=True):
    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based line of the input file


class BatchErrors(Struct, kw_only=True):
    data: list[BatchError]
    object: Literal["list"] = "list"


class Batch(Struct, kw_only=True):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    object: Literal["batch"] = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = msgspec.field(default_factory=BatchRequestCounts)
    metadata: dict[str, str] | None = None


class BatchList(Struct, kw_only=True):
    data: list[Batch]
    object: Literal["list"] = "list"
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


# -- lines of batch files ---------------------------------------------------------------------


class BatchInputLine(Struct, kw_only=True):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class BatchLineResponse(Struct, kw_only=True):
    status_code: int
    request_id: str
    body: msgspec.Raw  # the JSON the live route would have answered (a completion or an error body)


class BatchLineError(Struct, kw_only=True):
    code: str
    message: str


class BatchOutputLine(Struct, kw_only=True):
    id: str
    custom_id: str
    response: BatchLineResponse | None
    error: BatchLineError | None


def file_list(files: list[FileObject], limit: int) -> FileList:
    """A page of at most `limit` files, from `limit` + 1 fetched (the extra one says there are more)."""
    page = files[:limit]
    first, last = (page[0].id, page[-1].id) if page else (None, None)
    return FileList(data=page, first_id=first, last_id=last, has_more=len(files) > limit)


def batch_list(batches: list[Batch], limit: int) -> BatchList:
    page = batches[:limit]
    first, last = (page[0].id, page[-1].id) if page else (None, None)
    return BatchList(data=page, first_id=first, last_id=last, has_more=len(batches) > limit)
