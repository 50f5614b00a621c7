"""Cancel work whose client has gone away.

A whole (non-streamed) response gives the app no signal when its client disconnects: only a call to
the ASGI `receive` reports `http.disconnect`. So while a route computes, a watcher waits on `receive`
and cancels the work the moment the client leaves; the work's `finally` then aborts the engine
request, freeing its blocks. (Streamed responses get the same from Litestar's Stream, which listens
for the disconnect itself.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from litestar.types import Receive

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
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnectedError("the client disconnected before the response")
    return task.result()
