"""Interleave several output streams (one per prompt of a batched completions request) in arrival order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def merge(sources: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yield (source index, item) as items arrive. The first error is raised here; leaving early
    cancels every pump, so no source is read after the consumer stops."""
    if len(sources) == 1:  # the common case needs no task hop
        async for only in sources[0]:
            yield 0, only
        return
    # an item, a source's error, or None when a source is exhausted
    queue: asyncio.Queue[tuple[int, T] | Exception | None] = asyncio.Queue()

    async def pump(i: int, src: AsyncIterator[T]) -> None:
        try:
            async for value in src:
                queue.put_nowait((i, value))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sources)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                remaining -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
