"""What runs one batch request: the gateway's upstream, answering it as its live route would
(backends/local.py: the same strict decoding, planning and whole-response assembly, at the batch's
priority; backends/fleet/batch.py: the same routing), as the batch's owner.

The result is what the route would have answered: the status code and the JSON body, a completion
or an OpenAI error. Errors that say the gateway cannot take work now (a full queue, a stopped or
draining engine, no backend up) are raised instead, so the runner retries the request later rather
than fail it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.errors import InvalidRequestError

if TYPE_CHECKING:
    from gateway.state import Gateway

BATCH_PRIORITY = 10  # engine priority of batch requests: interactive ones (0) are scheduled first


@dataclass(frozen=True, slots=True)
class Answer:
    status_code: int
    body: bytes  # JSON


# (endpoint, body, request id, priority, the batch owner's tenant) -> the answer; raises QueueFullError
# or ServiceUnavailableError when the request cannot be taken now (the runner retries it later). A
# request runs as its batch's owner: in that tenant's prefix-cache partition.
Executor = Callable[[str, bytes, str, int, str], Awaitable[Answer]]


def refuse_stream(stream: bool | None) -> None:
    if stream:
        raise InvalidRequestError("stream is not supported in a batch request", param="stream")


def upstream_executor(gw: Gateway) -> Executor:
    """The batch runner's executor: the gateway's upstream, whatever it is."""

    async def execute(endpoint: str, raw: bytes, rid: str, priority: int, owner: str) -> Answer:
        return await gw.upstream.execute(gw, endpoint, raw, rid, priority, owner)

    return execute
