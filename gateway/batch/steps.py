"""What the batch runner (batch/runner.py) writes for a batch, apart from driving it: the check of its
input, its expiry, the output lines it stores, and how a failed or paused batch reads to its client.
The store calls here are synchronous (the runner calls them on a worker thread)."""

from __future__ import annotations

import uuid

import msgspec

from gateway.batch.executor import Answer
from gateway.batch.input import BatchItem, parse_batch_input
from gateway.batch.store_api import Store
from gateway.encoding import encode
from shared.batch_protocol import (
    Batch,
    BatchError,
    BatchErrors,
    BatchLineError,
    BatchLineResponse,
    BatchOutputLine,
)
from shared.storage_faults import StorageFault


def output_line(
    item: BatchItem, answer: Answer | None, rid: str, error: BatchLineError | None = None
) -> bytes:
    """One line of the batch's output (or error) file for `item`."""
    response = None
    if answer is not None:
        body = msgspec.Raw(answer.body)
        response = BatchLineResponse(status_code=answer.status_code, request_id=rid, body=body)
    line = BatchOutputLine(
        id=f"batch_req_{uuid.uuid4().hex[:24]}", custom_id=item.custom_id, response=response, error=error
    )
    return encode(line)


def failure(exc: BaseException, attempts: int) -> BatchErrors:
    """Why a batch failed after `attempts` unexpected errors in a row."""
    # the type only: the message may name server internals; the log has the traceback
    message = f"the server failed on this batch {attempts} times ({type(exc).__name__}); it has been logged"
    return BatchErrors(data=[BatchError(code="server_error", message=message)])


def paused(batch: Batch, fault: StorageFault) -> Batch:
    """The batch with the reason it waits for its disk in `errors` (its status is unchanged)."""
    reason = f"paused: {fault.message}; the batch goes on by itself once the write succeeds"
    errors = BatchErrors(data=[BatchError(code=fault.code or "storage", message=reason)])
    return msgspec.structs.replace(batch, errors=errors)


def validate(store: Store, batch: Batch) -> None:
    """validating -> in_progress with its requests, or failed with the input's errors."""
    content = store.file_content(batch.input_file_id)
    if content is None:
        message = f"the input file {batch.input_file_id} expired or was deleted before the batch ran"
        error = BatchError(code="invalid_file", message=message, param="input_file_id")
        store.fail_validation(batch.id, BatchErrors(data=[error]))
        return
    parsed = parse_batch_input(content, batch.endpoint)
    items = [p for p in parsed if isinstance(p, BatchItem)]
    errors = [p for p in parsed if isinstance(p, BatchError)]
    if errors:
        store.fail_validation(batch.id, BatchErrors(data=errors))
    else:
        store.start(batch.id, items)  # None: cancelled meanwhile, which the next turn finishes


def expire(store: Store, batch: Batch) -> None:
    """Past its window: its unrun requests fail as expired, and the batch ends."""
    error = BatchLineError(code="batch_expired", message="the batch expired before this request ran")
    for item in store.pending(batch.id):
        store.put_result(batch.id, item.line, False, output_line(item, None, "", error))
    store.finish(batch.id, "expired")
