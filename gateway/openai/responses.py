"""The Responses API (`POST /v1/responses`, and GET / DELETE / input_items of a stored response),
answered through the gateway's own chat completions (routes.chat_answer): the same checks of model,
key and limits, over whichever upstream serves chat (the engine or the fleet), and the same typed
answer the chat route encodes (a ChatCompletion or its chunks); only a relayed answer, from a server
that is not ours, is read back from its bytes (responses_stream.typed).

responses_convert.py translates the request and the whole answer, responses_stream.py the stream,
response_store.py keeps stored responses per tenant. Served on the OpenAI port only (not on a
worker): responses are stored by the gateway that made them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from litestar import Request, Response, delete, get, post
from litestar.background_tasks import BackgroundTask
from litestar.params import FromPath, FromQuery, QueryParameter

from gateway.access.auth import principal_of
from gateway.encoding import encode
from gateway.openai.decode import decode_body
from gateway.openai.response_store import NotStored, Responses, store_at
from gateway.openai.responses_convert import (
    Draft,
    chat_body,
    input_items,
    refuse_unsupported,
    whole_response,
)
from gateway.openai.responses_stream import retell, typed
from gateway.openai.routes import chat_answer, gateway_of
from gateway.upstream import Answered
from shared.disconnect import WatchedStream
from shared.errors import CtxfuseError, InvalidRequestError, NotFoundError
from shared.protocol import ChatCompletionRequest
from shared.responses_protocol import (
    InputItemList,
    Item,
    ResponseDeleted,
    ResponsesRequest,
)
from shared.responses_protocol import (
    Response as ResponseObject,
)

AnyRequest = Request[Any, Any, Any]
_JSON = "application/json"


async def _store(request: AnyRequest) -> Responses:
    """The app's store; the first call opens it on a worker thread (SQLite never runs on the loop)."""
    store = request.app.state.get("responses")
    if store is not None:
        return store
    gw = gateway_of(request)
    return await asyncio.to_thread(store_at, request.app.state, gw.config.data / "responses.sqlite", gw.redis)


def _tenant(request: AnyRequest) -> str:
    """The tenant whose responses a request sees (access/auth.py), as files and batches."""
    return principal_of(request.state).tenant


def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"no response with id {response_id!r}", param="response_id", code="not_found")


async def _conversation(request: AnyRequest, req: ResponsesRequest) -> list[Item]:
    """The items the answer sees: a previous response's input and output, then this input."""
    items = input_items(req)
    prev_id = req.previous_response_id
    if prev_id is None:
        return items
    store = await _store(request)
    prev = await asyncio.to_thread(store.get, _tenant(request), prev_id)
    if prev is None:
        raise NotFoundError(
            f"no response with id {prev_id!r}", param="previous_response_id", code="not_found"
        )
    if isinstance(prev, NotStored):
        raise InvalidRequestError(
            f"response {prev_id!r} was made with store=false, so its conversation was not kept; send "
            "the earlier turns in `input`",
            param="previous_response_id",
        )
    return [*prev.input_items, *prev.response.output, *items]


@post("/v1/responses", status_code=200, summary="Create a model response (OpenAI Responses API)")
async def create_response(request: AnyRequest) -> Answered:
    arrival = time.monotonic()
    req = decode_body(await request.body(), ResponsesRequest)
    refuse_unsupported(req)
    items = await _conversation(request, req)
    draft = Draft.of(req)
    store, tenant = await _store(request), _tenant(request)

    async def keep(response: ResponseObject) -> None:
        await asyncio.to_thread(store.put, tenant, response, items)

    raw = chat_body(req, items)
    answer = await chat_answer(request, decode_body(raw, ChatCompletionRequest), raw, arrival)
    if answer.relayed is not None:
        if (answer.relayed.status_code or 200) >= 400:
            return answer.relayed  # the chat path's error, in our error shape, as it came
        answer = typed(answer.relayed)
    if answer.chunks is not None:
        return WatchedStream(
            retell(answer.chunks, draft, keep),
            media_type="text/event-stream",
            headers=answer.headers,
            background=BackgroundTask(_on_loop(answer.close)),  # if the body never starts
        )
    if answer.whole is None:
        raise CtxfuseError("the upstream answered with neither a completion nor a stream")
    response = whole_response(draft, answer.whole)
    await keep(response)
    return Response(encode(response), media_type=_JSON, headers=answer.headers)


def _on_loop(close: Callable[[], None]) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        close()

    return run


@get("/v1/responses/{response_id:str}", summary="Retrieve a stored model response")
async def retrieve_response(
    request: AnyRequest, response_id: FromPath[str], stream: FromQuery[bool] = False
) -> Response[bytes]:
    if stream:
        raise InvalidRequestError(
            "only a background response can be streamed on retrieval, and background responses are "
            "not supported here; retrieve it without `stream`",
            param="stream",
        )
    store = await _store(request)
    body = await asyncio.to_thread(store.response_json, _tenant(request), response_id)
    if body is None:
        raise _not_found(response_id)
    return Response(body, media_type=_JSON)


@delete("/v1/responses/{response_id:str}", status_code=200, summary="Delete a stored model response")
async def delete_response(request: AnyRequest, response_id: FromPath[str]) -> Response[bytes]:
    store = await _store(request)
    if not await asyncio.to_thread(store.delete, _tenant(request), response_id):
        raise _not_found(response_id)
    return Response(encode(ResponseDeleted(id=response_id)), media_type=_JSON)


@get("/v1/responses/{response_id:str}/input_items", summary="List a stored response's input items")
async def list_input_items(
    request: AnyRequest,
    response_id: FromPath[str],
    limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20,
    order: FromQuery[Literal["asc", "desc"]] = "desc",
    after: FromQuery[str | None] = None,
) -> Response[bytes]:
    store = await _store(request)
    found = await asyncio.to_thread(store.get, _tenant(request), response_id)
    if found is None or isinstance(found, NotStored):
        raise _not_found(response_id)
    items = found.input_items if order == "asc" else found.input_items[::-1]
    if after is not None:  # items after the cursor; an unknown cursor pages from nothing
        ids = [item.id for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    listed = InputItemList(
        data=page,
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=len(items) > limit,
    )
    return Response(encode(listed), media_type=_JSON)


ROUTES = [create_response, retrieve_response, delete_response, list_input_items]
