"""OpenAI's Files and Batch API: upload a JSONL of requests, create a batch over it, poll it, cancel it,
and download its output and error files. The work itself is the runner's (batch/runner.py).

POST /v1/files and POST /v1/batches honour an `Idempotency-Key` header: the same key with the same
request answers the object the first call created (nothing is created or run twice, across restarts
too); the same key with a different request is a 422 (`idempotency_key_reused`).

Files expire as OpenAI's do: `expires_after[anchor]=created_at` and `expires_after[seconds]=N` on an
upload, `output_expires_after` on a batch for its output and error files (N from an hour to 30 days).
An expired file is gone at once (404, out of lists); the runner's sweep frees its space later.

Every store call runs on a worker thread (`_off_loop`): SQLite waits on the disk (Redis, with
`--redis-url`, on the network), and a slow disk must stall these routes only, never /health or a chat
stream. File content goes out in pieces. With Redis, every replica answers for every file, batch and
key; while Redis cannot be reached these routes answer 503 (SharedStateDown), never from this
replica's own state.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, ParamSpec, TypeVar

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.params import FromPath, FromQuery, QueryParameter
from litestar.response import Stream

from gateway.access.auth import principal_of
from gateway.batch.files import ContentRef, Idem, KeyReused
from gateway.batch.runner import BatchRunner
from gateway.batch.store import WINDOW_S
from gateway.batch.store_api import Store
from gateway.encoding import encode
from gateway.errors import ConflictError, IdempotencyKeyReusedError, RequestTooLargeError
from gateway.openai.decode import decode_body
from shared.batch_protocol import (
    BATCH_ENDPOINTS,
    BatchCreateRequest,
    FileDeleted,
    FileObject,
    batch_list,
    file_list,
)
from shared.disconnect import WatchedStream
from shared.errors import InvalidRequestError, NotFoundError
from shared.file_expiry import check_output_expiry, upload_expiry

MAX_FILE_BYTES = 100 * 2**20  # per uploaded file (OpenAI allows 200 MB for batch input)
_FORM_OVERHEAD = 2**20  # multipart boundaries and headers around the file
MAX_KEY_CHARS = 255
_PIECE_BYTES = 2**20  # file content is read and sent this much at a time
AnyRequest = Request[Any, Any, Any]
T = TypeVar("T")
P = ParamSpec("P")


def _runner(request: AnyRequest) -> BatchRunner:
    runner: BatchRunner = request.app.state.batches
    return runner


async def _off_loop(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """A store call on a worker thread (the stores are thread-safe: SQLite's one connection behind a
    lock, Redis's client a connection pool)."""
    return await asyncio.to_thread(call, *args, **kwargs)


def _json(obj: object) -> Response[bytes]:
    return Response(encode(obj), media_type="application/json")


def _owner(request: AnyRequest) -> str:
    """The tenant whose files and batches a request sees (access/auth.py; a device's own on the edge
    listener)."""
    return principal_of(request.state).tenant


def _idem(request: AnyRequest, route: str, *parts: bytes) -> Idem | None:
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not 0 < len(key) <= MAX_KEY_CHARS:
        raise InvalidRequestError(f"Idempotency-Key must be 1 to {MAX_KEY_CHARS} characters")
    digest = hashlib.sha256()
    for part in parts:  # length-prefixed, so no two different part lists hash alike
        digest.update(len(part).to_bytes(8, "big") + part)
    # scoped by tenant (a separator no tenant name holds): one tenant's key never names another's object
    return Idem(route, f"{_owner(request)}\x1f{key}", digest.digest())


def _created(obj: T | KeyReused) -> T:
    if isinstance(obj, KeyReused):
        raise IdempotencyKeyReusedError()
    return obj


# -- files ------------------------------------------------------------------------------------


async def _upload(request: AnyRequest) -> tuple[str, UploadFile, int | None]:
    if request.content_type[0] != "multipart/form-data":
        raise InvalidRequestError("send the file as multipart/form-data with `file` and `purpose` fields")
    form = await request.form()
    purpose, upload = form.get("purpose"), form.get("file")
    if not isinstance(purpose, str):
        raise InvalidRequestError("the form needs a `purpose` field", param="purpose")
    if purpose != "batch":
        raise InvalidRequestError(f"purpose {purpose!r} is not supported here; use 'batch'", param="purpose")
    if not isinstance(upload, UploadFile):
        raise InvalidRequestError("the form needs a `file` field holding the file", param="file")
    return purpose, upload, upload_expiry(form)


@post(
    "/v1/files",
    status_code=200,
    summary="Upload a file (OpenAI; purpose batch: JSONL of requests)",
    request_max_body_size=MAX_FILE_BYTES + _FORM_OVERHEAD,
)
async def create_file(request: AnyRequest) -> Response[bytes]:
    purpose, upload, ttl_s = await _upload(request)
    try:
        content = await upload.read()
    finally:
        await upload.close()
    if len(content) > MAX_FILE_BYTES:
        raise RequestTooLargeError(f"the file is over {MAX_FILE_BYTES} bytes", param="file", code="too_large")
    name = upload.filename or "upload.jsonl"
    # the lifetime is part of the request only when given, so keys from before it still match
    lifetime = () if ttl_s is None else (str(ttl_s).encode(),)
    idem = _idem(request, "/v1/files", purpose.encode(), name.encode(), content, *lifetime)
    store = _runner(request).store
    return _json(
        _created(await _off_loop(store.put_file, purpose, name, content, idem, ttl_s, owner=_owner(request)))
    )


@get("/v1/files", summary="List files (OpenAI)")
async def list_files(
    request: AnyRequest,
    limit: Annotated[int, QueryParameter(ge=1, le=10_000)] = 10_000,
    after: FromQuery[str | None] = None,
    purpose: FromQuery[str | None] = None,
) -> Response[bytes]:
    files = await _off_loop(_runner(request).store.list_files, limit, after, purpose, owner=_owner(request))
    return _json(file_list(files, limit))


async def _file_or_404(request: AnyRequest, file_id: str) -> FileObject:
    f = await _off_loop(_runner(request).store.get_file, file_id, _owner(request))
    if f is None:
        raise NotFoundError(f"no file with id {file_id!r}", param="file_id", code="file_not_found")
    return f


@get("/v1/files/{file_id:str}", summary="Retrieve a file's description (OpenAI)")
async def retrieve_file(request: AnyRequest, file_id: FromPath[str]) -> Response[bytes]:
    return _json(await _file_or_404(request, file_id))


@get("/v1/files/{file_id:str}/content", summary="A file's content (OpenAI; batch results are JSONL)")
async def file_content(request: AnyRequest, file_id: FromPath[str]) -> Stream:
    store = _runner(request).store
    ref = await _off_loop(store.content_ref, file_id, _owner(request))
    if ref is None:
        raise NotFoundError(f"no file with id {file_id!r}", param="file_id", code="file_not_found")
    headers = {"content-length": str(ref.size)}
    return WatchedStream(_pieces(store, ref), media_type="application/octet-stream", headers=headers)


async def _pieces(store: Store, ref: ContentRef) -> AsyncIterator[bytes]:
    """The content a piece at a time; a file deleted meanwhile ends short (the client sees the cut)."""
    for offset in range(0, ref.size, _PIECE_BYTES):
        piece = await _off_loop(store.read_content, ref, offset, _PIECE_BYTES)
        if not piece:
            return
        yield piece


@delete("/v1/files/{file_id:str}", status_code=200, summary="Delete a file (OpenAI)")
async def delete_file(request: AnyRequest, file_id: FromPath[str]) -> Response[bytes]:
    if not await _off_loop(_runner(request).store.delete_file, file_id, owner=_owner(request)):
        raise NotFoundError(f"no file with id {file_id!r}", param="file_id", code="file_not_found")
    return _json(FileDeleted(id=file_id))


# -- batches ----------------------------------------------------------------------------------


async def _check_batch(req: BatchCreateRequest, request: AnyRequest) -> None:
    if req.endpoint not in BATCH_ENDPOINTS:
        supported = ", ".join(BATCH_ENDPOINTS)
        raise InvalidRequestError(f"endpoint must be one of {supported}", param="endpoint")
    if req.completion_window not in WINDOW_S:
        raise InvalidRequestError("completion_window must be '24h'", param="completion_window")
    meta = req.metadata or {}
    if len(meta) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        raise InvalidRequestError(
            "metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters", param="metadata"
        )
    check_output_expiry(req)
    f = await _off_loop(_runner(request).store.get_file, req.input_file_id, _owner(request))
    if f is None:
        raise NotFoundError(f"no file with id {req.input_file_id!r}", param="input_file_id")
    if f.purpose != "batch":
        raise InvalidRequestError("the input file's purpose must be 'batch'", param="input_file_id")


@post("/v1/batches", status_code=200, summary="Create a batch (OpenAI)")
async def create_batch(request: AnyRequest) -> Response[bytes]:
    req = decode_body(await request.body(), BatchCreateRequest)
    await _check_batch(req, request)
    idem = _idem(request, "/v1/batches", msgspec.json.encode(req, order="sorted"))
    runner = _runner(request)
    batch = _created(await _off_loop(runner.store.create_batch, req, idem, owner=_owner(request)))
    runner.wake()
    return _json(batch)


@get("/v1/batches", summary="List batches, newest first (OpenAI)")
async def list_batches(
    request: AnyRequest,
    limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20,
    after: FromQuery[str | None] = None,
) -> Response[bytes]:
    runner = _runner(request)
    batches = await _off_loop(runner.store.list_batches, limit, after, owner=_owner(request))
    return _json(batch_list([runner.shown(b) for b in batches], limit))


@get("/v1/batches/{batch_id:str}", summary="Retrieve a batch (OpenAI)")
async def retrieve_batch(request: AnyRequest, batch_id: FromPath[str]) -> Response[bytes]:
    batch = await _off_loop(_runner(request).store.get_batch, batch_id, _owner(request))
    if batch is None:
        raise NotFoundError(f"no batch with id {batch_id!r}", param="batch_id")
    return _json(_runner(request).shown(batch))


@post("/v1/batches/{batch_id:str}/cancel", status_code=200, summary="Cancel a batch (OpenAI)")
async def cancel_batch(request: AnyRequest, batch_id: FromPath[str]) -> Response[bytes]:
    runner = _runner(request)
    owner = _owner(request)
    batch = await _off_loop(
        runner.store.transition, batch_id, "cancelling", only_from=("validating", "in_progress"), owner=owner
    )
    if batch is None:
        batch = await _off_loop(runner.store.get_batch, batch_id, owner)
        if batch is None:
            raise NotFoundError(f"no batch with id {batch_id!r}", param="batch_id")
        if batch.status not in ("cancelling", "cancelled"):
            raise ConflictError(f"a batch that is {batch.status} cannot be cancelled", code="invalid_state")
    runner.wake()
    return _json(batch)


ROUTES = [
    create_file,
    list_files,
    retrieve_file,
    file_content,
    delete_file,
    create_batch,
    list_batches,
    retrieve_batch,
    cancel_batch,
]
