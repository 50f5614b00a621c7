"""Cancel work whose client has gone away.

A whole (non-streamed) response gives the app no signal when its client disconnects: only a call to
the ASGI `receive` reports `http.disconnect`. So while a route computes, a watcher waits on `receive`
and cancels the work the moment the client leaves; the work's `finally` then aborts the engine
request, freeing its blocks. (Streamed responses get the same from Litestar's Stream, which listens
for the disconnect itself.)
"""

from __future__ import annotations

import asyncio
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
