"""The agent's Files and Batch API: what an app uploads and creates is stored in the outbox (outbox.py)
and answered at once with local ids, whether or not the gateway can be reached; the forwarder
(forwarder.py) runs it on the gateway. A batch reads "validating" until the gateway has it, then
mirrors the gateway's view; its output and error files are readable here once fetched.

POST /v1/files and POST /v1/batches honour an app's `Idempotency-Key` as the gateway does: the same
key with the same request answers the first object; with a different request, a 422.

Cancel follows OpenAI: a batch the gateway does not have yet is cancelled here at once; one it has
reads "cancelling" until the forwarder has told the gateway and fetched its outcome ("cancelled").
Lists page newest first with `limit` and an `after` cursor, as the gateway's do.

What the outbox's disk refuses (shared/storage_faults.py) is answered by `storage_refused`, the agent
app's handler for StorageFault: a 507 `insufficient_storage` when it is full (an upload under the
free-space floor too), a 503 when it is read-only, damaged or failing, with Retry-After; nothing was
stored, and what was stored before is kept.

Files expire as on the gateway, under the same rules (shared/file_expiry.py): `expires_after` on an
upload, `output_expires_after` on a batch for its result files. An expired file is gone here (404, out
of lists); the forwarder uploads an input with the lifetime it has left (forwarder.gateway_ttl).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.params import FromPath, FromQuery, QueryParameter

from shared.batch_protocol import BATCH_ENDPOINTS, BatchCreateRequest, FileDeleted, batch_list, file_list
from shared.errors import InvalidRequestError
from shared.file_expiry import check_output_expiry, upload_expiry
from shared.storage_faults import StorageFault

from .errors import JSON, error_response
from .outbox_values import FileInUse, KeyReused, NotCancellable, OutboxFull

if TYPE_CHECKING:
    from .agent import Agent

AnyRequest = Request[Any, Any, Any]
MAX_FILE_BYTES = 100 * 2**20  # as the gateway takes
_FORM_OVERHEAD = 2**20


def _agent(request: AnyRequest) -> Agent:
    agent: Agent = request.app.state.agent
    return agent


def _json(obj: object) -> Response[bytes]:
    return Response(msgspec.json.encode(obj), media_type=JSON)


def _digest(*parts: bytes) -> bytes:
    digest = hashlib.sha256()
    for part in parts:  # length-prefixed, so no two different part lists hash alike
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.digest()


def _key_reused() -> Response[bytes]:
    return error_response(
        422, "this Idempotency-Key was used with a different request", "idempotency_key_reused"
    )


def _invalid(exc: InvalidRequestError) -> Response[bytes]:
    return error_response(400, exc.message, exc.code or "invalid_request", param=exc.param)


def _not_found(what: str, ident: str) -> Response[bytes]:
    return error_response(404, f"no {what} with id {ident!r}", f"{what}_not_found")


def storage_refused(request: AnyRequest, exc: Exception) -> Response[bytes]:
    """The agent app's answer to a StorageFault (the outbox's disk refused): its status, code and
    client message (the store named, no path), with Retry-After."""
    if not isinstance(exc, StorageFault):  # (registered for StorageFault only)
        raise exc
    return error_response(
        exc.status, exc.message, exc.code or "storage_failing", {"Retry-After": str(int(exc.retry_after_s))}
    )


@post("/v1/files", status_code=200, request_max_body_size=MAX_FILE_BYTES + _FORM_OVERHEAD)
async def create_file(request: AnyRequest) -> Response[bytes]:
    if request.content_type[0] != "multipart/form-data":
        return error_response(
            400, "send the file as multipart/form-data with `file` and `purpose`", "bad_form"
        )
    form = await request.form()
    purpose, upload = form.get("purpose"), form.get("file")
    if purpose != "batch" or not isinstance(upload, UploadFile):
        return error_response(400, "the form needs `purpose` 'batch' and a `file`", "bad_form")
    try:
        ttl_s = upload_expiry(form)
        content = await upload.read()
    except InvalidRequestError as exc:
        return _invalid(exc)
    finally:
        await upload.close()
    name = upload.filename or "upload.jsonl"
    agent = _agent(request)
    key = request.headers.get("idempotency-key")
    # the lifetime is part of the request only when given, so keys from before it still match
    lifetime = () if ttl_s is None else (str(ttl_s).encode(),)
    digest = _digest(purpose.encode(), name.encode(), content, *lifetime)
    made = await asyncio.to_thread(agent.outbox.put_file, name, purpose, content, key, digest, ttl_s)
    if isinstance(made, KeyReused):
        return _key_reused()
    if isinstance(made, OutboxFull):
        return error_response(
            429,
            f"the outbox is full: the file needs {made.needed} bytes, {made.free} are free; retry later",
            "outbox_full",
            {"Retry-After": str(agent.config.retry_after_s)},
        )
    return _json(made)


@post("/v1/batches", status_code=200)
async def create_batch(request: AnyRequest) -> Response[bytes]:
    raw = await request.body()
    try:
        req = msgspec.json.decode(raw, type=BatchCreateRequest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return error_response(400, f"the request body is not a batch request ({exc})", "invalid_request")
    if req.endpoint not in BATCH_ENDPOINTS:
        return error_response(
            400, f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}", "invalid_endpoint"
        )
    if req.completion_window != "24h":
        return error_response(400, "completion_window must be '24h'", "invalid_completion_window")
    try:
        check_output_expiry(req)  # here, not first at the gateway: the app gets the 400 at once
    except InvalidRequestError as exc:
        return _invalid(exc)
    agent = _agent(request)
    if await asyncio.to_thread(agent.outbox.get_file, req.input_file_id) is None:
        return _not_found("file", req.input_file_id)
    key = request.headers.get("idempotency-key")
    digest = _digest(msgspec.json.encode(req, order="sorted"))
    made = await asyncio.to_thread(agent.outbox.create_batch, req, key, digest)
    if isinstance(made, KeyReused):
        return _key_reused()
    agent.forwarder.wake()
    return _json(made)


@get("/v1/batches/{batch_id:str}")
async def retrieve_batch(request: AnyRequest, batch_id: FromPath[str]) -> Response[bytes]:
    batch = await asyncio.to_thread(_agent(request).outbox.get_batch, batch_id)
    return _not_found("batch", batch_id) if batch is None else _json(batch)


@get("/v1/batches")
async def list_batches(
    request: AnyRequest,
    limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20,
    after: FromQuery[str | None] = None,
) -> Response[bytes]:
    batches = await asyncio.to_thread(_agent(request).outbox.list_batches, limit, after)
    return _json(batch_list(batches, limit))


@post("/v1/batches/{batch_id:str}/cancel", status_code=200)
async def cancel_batch(request: AnyRequest, batch_id: FromPath[str]) -> Response[bytes]:
    agent = _agent(request)
    batch = await asyncio.to_thread(agent.outbox.cancel, batch_id)
    if batch is None:
        return _not_found("batch", batch_id)
    if isinstance(batch, NotCancellable):
        return error_response(409, f"a batch that is {batch.status} cannot be cancelled", "invalid_state")
    agent.forwarder.wake()
    return _json(batch)


@get("/v1/files")
async def list_files(
    request: AnyRequest,
    limit: Annotated[int, QueryParameter(ge=1, le=10_000)] = 10_000,
    after: FromQuery[str | None] = None,
    purpose: FromQuery[str | None] = None,
) -> Response[bytes]:
    files = await asyncio.to_thread(_agent(request).outbox.list_files, limit, after, purpose)
    return _json(file_list(files, limit))


@delete("/v1/files/{file_id:str}", status_code=200)
async def delete_file(request: AnyRequest, file_id: FromPath[str]) -> Response[bytes]:
    gone = await asyncio.to_thread(_agent(request).outbox.delete_file, file_id)
    if isinstance(gone, FileInUse):
        return error_response(
            409, f"batch {gone.batch_id} still needs this file on its way to the gateway", "file_in_use"
        )
    return _json(FileDeleted(id=file_id)) if gone else _not_found("file", file_id)


@get("/v1/files/{file_id:str}")
async def retrieve_file(request: AnyRequest, file_id: FromPath[str]) -> Response[bytes]:
    f = await asyncio.to_thread(_agent(request).outbox.get_file, file_id)
    return _not_found("file", file_id) if f is None else _json(f)


@get("/v1/files/{file_id:str}/content")
async def file_content(request: AnyRequest, file_id: FromPath[str]) -> Response[bytes]:
    content = await asyncio.to_thread(_agent(request).outbox.file_content, file_id)
    if content is None:
        return _not_found("file", file_id)
    return Response(content, media_type="application/octet-stream")


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
