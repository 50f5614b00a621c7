"""Cancel work whose client has gone away.

A response gives the app no signal when its client disconnects: only a call to the ASGI `receive`
reports `http.disconnect` (uvicorn drops what is sent after it without a word). So while a route
computes, or a stream is sent, a watcher waits on `receive` and cancels the work the moment the
client leaves; the work's `finally` then aborts the engine request, freeing its blocks.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any, TypeVar

from litestar import Litestar, Request
from litestar.background_tasks import BackgroundTask, BackgroundTasks
from litestar.datastructures.cookie import Cookie
from litestar.enums import MediaType
from litestar.response.base import ASGIResponse
from litestar.response.streaming import ASGIStreamingResponse, Stream
from litestar.types import Receive, Send, TypeEncodersMap
from litestar.utils.helpers import get_enum_string_value

from shared.errors import CtxfuseError

T = TypeVar("T")


class ClientDisconnectedError(CtxfuseError):
    """The client closed the connection before its response; nothing is sent (logged as 499)."""

    status = 499
    type = "client_closed_request"


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """`work`, awaited in this task while a watcher task waits on `receive`: a disconnect cancels
    this task (so the work's `finally` runs) and comes out as ClientDisconnectedError. One task
    beside the caller's, not two and an `asyncio.wait`: this runs on every whole answer."""
    me = asyncio.current_task()
    if me is None:
        raise RuntimeError("cancel_on_disconnect runs inside a task")
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _wait_disconnect(receive)
        gone = True
        me.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise  # cancelled from outside (a shutdown): not ours to answer
        me.uncancel()
        raise ClientDisconnectedError("the client disconnected before the response") from None
    finally:
        watcher.cancel()


class WatchedStream(Stream):
    """Litestar's Stream, sent from the response's own task with one watcher for the client's
    disconnect (cancel_on_disconnect), where Litestar's runs every stream in an anyio task group
    and ends it by cancelling a scope (~50 us a response more, in-process). A
    disconnect stops the stream and closes its iterator, whose `finally` frees what it holds."""

    def to_asgi_response(
        self,
        app: Litestar | None,
        request: Request[Any, Any, Any],
        *,
        background: BackgroundTask | BackgroundTasks | None = None,
        cookies: Iterable[Cookie] | None = None,
        encoded_headers: Iterable[tuple[bytes, bytes]] | None = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        media_type: str | None = None,
        status_code: int | None = None,
        type_encoders: TypeEncodersMap | None = None,
    ) -> ASGIResponse:
        if not isinstance(self.iterator, AsyncIterator):
            raise TypeError("a WatchedStream streams an async iterator")
        return _WatchedResponse(
            iterator=self.iterator,
            background=self.background or background,
            content_length=0,
            cookies=self.cookies if cookies is None else itertools.chain(self.cookies, cookies),
            encoded_headers=encoded_headers,
            encoding=self.encoding,
            headers={**headers, **self.headers} if headers is not None else self.headers,
            is_head_response=is_head_response,
            media_type=get_enum_string_value(self.media_type or media_type or MediaType.JSON),
            status_code=self.status_code or status_code,
        )


class _WatchedResponse(ASGIStreamingResponse):
    __slots__ = ()

    async def send_body(self, send: Send, receive: Receive) -> None:
        iterator = self.iterator
        try:
            await cancel_on_disconnect(receive, self._stream(send))
        except ClientDisconnectedError:
            pass  # nobody is left to send the rest to
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:  # stopped while sending, not inside the iterator: close it now
                await aclose()
