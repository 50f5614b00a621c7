"""The rules for a batch input file: JSONL, one request per line, checked as a whole before any runs.

Each non-blank line must be a JSON object with a `custom_id` (a string unique in the file), `method`
"POST", `url` equal to the batch's endpoint and a JSON-object `body`. The body itself is decoded when
its request runs, by the live route's own decoder, so a body the route would refuse fails that one
request (in the error file), not the batch. A file that breaks a rule fails the whole batch, with each
offending line named (1-based) in the batch's `errors`, as OpenAI reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from shared.batch_protocol import BatchError, BatchInputLine

MAX_REQUESTS = 50_000  # per batch, as OpenAI
MAX_ERRORS = 100  # reported per batch; the first ones, in line order

_decoder = msgspec.json.Decoder(BatchInputLine)


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One request of a batch: its place in the input file, its id, and its JSON body."""

    line: int
    custom_id: str
    body: bytes


def _check_line(no: int, text: bytes, endpoint: str, seen: set[str]) -> BatchItem | BatchError:
    try:
        item = _decoder.decode(text)
    except msgspec.ValidationError as exc:
        return BatchError(code="invalid_request", message=f"line {no}: {exc}", line=no)
    except msgspec.DecodeError:
        return BatchError(code="invalid_json_line", message=f"line {no} is not a JSON object", line=no)
    if item.custom_id in seen:
        message = f"line {no}: custom_id {item.custom_id!r} is used by an earlier line; each must be unique"
        return BatchError(code="duplicate_custom_id", message=message, param="custom_id", line=no)
    if item.method != "POST":
        message = f"line {no}: method must be POST, got {item.method!r}"
        return BatchError(code="invalid_method", message=message, param="method", line=no)
    if item.url != endpoint:
        message = f"line {no}: url {item.url!r} differs from the batch's endpoint {endpoint!r}"
        return BatchError(code="mismatched_url", message=message, param="url", line=no)
    body = bytes(item.body)
    if not body.lstrip().startswith(b"{"):
        message = f"line {no}: body must be a JSON object"
        return BatchError(code="invalid_request", message=message, param="body", line=no)
    seen.add(item.custom_id)
    return BatchItem(no, item.custom_id, body)


def parse_batch_input(content: bytes, endpoint: str) -> list[BatchItem] | list[BatchError]:
    """The file's requests in line order, or its errors (at most MAX_ERRORS) when any line is bad."""
    items: list[BatchItem] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    for no, text in enumerate(content.splitlines(), start=1):
        if not text.strip():
            continue  # blank lines (a trailing newline, say) hold no request
        checked = _check_line(no, text, endpoint, seen)
        if isinstance(checked, BatchError):
            errors.append(checked)
            if len(errors) >= MAX_ERRORS:
                break
        else:
            items.append(checked)
    if not errors and not items:
        errors.append(BatchError(code="empty_file", message="the input file holds no requests"))
    if not errors and len(items) > MAX_REQUESTS:
        message = f"the input file holds {len(items)} requests; a batch takes at most {MAX_REQUESTS}"
        errors.append(BatchError(code="too_many_requests", message=message))
    return errors or items
