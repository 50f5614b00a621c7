"""A request's outputs carried from the engine thread (or an engine process's reader) into the
caller's event loop: the queue each choice's outputs wait in until the caller iterates."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from shared.engine_types import RequestOutput
from shared.errors import EngineDeadError

if TYPE_CHECKING:
    from cloud.engine.serving.async_engine import AsyncEngine


class OutputStream:
    """A request's outputs in the caller's event loop, iterated until each of its n choices has
    finished; another thread feeds it through the loop (call_soon_threadsafe)."""

    def __init__(self, n: int) -> None:
        self.loop = asyncio.get_running_loop()  # where the outputs are consumed
        self._queue: asyncio.Queue[RequestOutput | EngineDeadError] = asyncio.Queue()
        self._remaining = n  # choices not yet finished, as the caller has seen them

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        while self._remaining:
            out = await self._queue.get()
            if isinstance(out, EngineDeadError):
                self._remaining = 0  # nothing more will come, and there is nothing left to abort
                raise out
            if out.finished:
                self._remaining -= 1
            yield out

    def fail(self, reason: str) -> None:
        """The engine died: the iteration raises EngineDeadError after what it already holds.
        Called on `loop` (another thread uses call_soon_threadsafe)."""
        self._queue.put_nowait(EngineDeadError(reason))


class RequestStream(OutputStream):
    """The outputs of one accepted request, carried from the engine thread into the caller's event
    loop. Closing it before every choice has finished aborts the request (freeing its blocks)."""

    def __init__(self, engine: AsyncEngine, n: int) -> None:
        super().__init__(n)
        self.request_id = ""
        self._engine = engine

    def sink(self, out: RequestOutput) -> None:  # called on the engine thread
        self.loop.call_soon_threadsafe(self._queue.put_nowait, out)

    def close(self) -> None:
        """Abort the request if any choice is unfinished; safe to call more than once."""
        if self._remaining and self.request_id:
            self._remaining = 0
            self._engine.abort(self.request_id)
