"""Server-sent events in OpenAI's framing, and the rule for failures mid-stream.

Once the first byte is out the status is 200 and cannot change, so a failure is sent as a final
`data: {"error": {...}}` event with no `[DONE]` after it: the official clients raise on it, and a
truncated answer is never mistaken for a whole one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import structlog
from litestar.response import Stream

from gateway.encoding import sse_event
from shared.disconnect import WatchedStream
from shared.errors import CtxfuseError

log = structlog.get_logger("ctxfuse.gateway")

_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _with_error_event(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event
    except CtxfuseError as exc:
        log.warning("stream_failed", error=exc.message, type=exc.type)
        yield sse_event(exc.to_openai())
    except Exception as exc:
        log.exception("stream_failed")
        yield sse_event(CtxfuseError(f"the stream failed: {type(exc).__name__}").to_openai())


def sse_stream(events: AsyncIterator[bytes]) -> Stream:
    return WatchedStream(_with_error_event(events), media_type="text/event-stream", headers=_HEADERS)
