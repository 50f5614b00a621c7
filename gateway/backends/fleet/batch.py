"""The Batch API in fleet mode: the batch runner (gateway/batch/runner.py) runs each request of a
batch through the same routing as a live one (keys, policy, canary, failover), whole rather than
streamed, and stores the backend's answer as the line's response.

A request that no backend could take (all down, all answering 5xx or 429) is not failed: the runner
retries it later, so a batch outlives an outage of the whole fleet. A backend's 4xx is the line's
answer, as the route would have given it. Backends run batch requests at their normal priority; the
runner's concurrency (a few at a time) is what keeps a batch from crowding out live traffic.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

from litestar.response import Stream

from gateway.access.auth import Principal
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.keys import RequestKeys
from gateway.backends.fleet.proxy import Outgoing, forward
from gateway.batch.executor import Answer, refuse_stream
from gateway.encoding import encode
from gateway.errors import ServiceUnavailableError
from gateway.openai.decode import decode_body
from gateway.upstream import CHAT_PATH
from shared.block_hash import salt_key
from shared.embeddings_protocol import EMBEDDINGS_PATH, EmbeddingRequest
from shared.errors import CtxfuseError
from shared.protocol import ChatCompletionRequest, CompletionRequest


async def execute_routed(fleet: Fleet, endpoint: str, raw: bytes, owner: str) -> Answer:
    """One batch request, routed like a live one as its batch's owner (FleetUpstream.execute)."""
    try:
        if endpoint == EMBEDDINGS_PATH:  # no prompt prefix to match: the least loaded backend
            model = decode_body(raw, EmbeddingRequest).model
            answer = await forward(fleet, Outgoing(endpoint, raw, RequestKeys([], ""), None, None, model))
        else:
            answer = await forward(fleet, await _outgoing(fleet, endpoint, raw, owner))
    except ServiceUnavailableError:
        raise  # no backend took it: the runner tries again later
    except CtxfuseError as exc:
        return Answer(exc.status, encode(exc.to_openai()))
    if isinstance(answer, Stream):  # a backend that streams what was asked whole: read it to its
        async for _ in cast(AsyncIterator[bytes], answer.iterator):  # end, which also settles
            pass  # the backend's count of work
        why = "the backend streamed a response asked for whole"
        return Answer(502, encode(CtxfuseError(why).to_openai()))
    return Answer(answer.status_code or 200, answer.content)


async def _outgoing(fleet: Fleet, endpoint: str, raw: bytes, owner: str) -> Outgoing:
    """A chat or completion batch request, keyed by its prompt's prefix like a live one."""
    req: ChatCompletionRequest | CompletionRequest
    if endpoint == CHAT_PATH:
        req = decode_body(raw, ChatCompletionRequest)
    else:
        req = decode_body(raw, CompletionRequest)
    refuse_stream(req.stream)
    salt = fleet.config.cache_salt(Principal(owner).cache_salt)  # the batch owner's partition
    extra = b"" if salt is None else salt_key(salt)
    keys, _ = await asyncio.to_thread(fleet.request_keys, req, False, extra)
    return Outgoing(endpoint, raw, keys, None, salt, req.model)
