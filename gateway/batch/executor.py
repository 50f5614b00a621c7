"""One batch request, run as its live route runs it: the same strict decoding, planning, engine
submission and whole-response assembly (openai/chat.py, openai/completions.py), at the batch's priority.

The result is what the route would have answered: the status code and the JSON body, a completion
or an OpenAI error. Errors that say the gateway cannot take work now (a full queue, a stopped or
draining engine) are raised instead, so the runner retries the request later rather than fail it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.access.auth import DEFAULT_TENANT, Principal
from gateway.encoding import encode
from gateway.errors import ServiceUnavailableError
from gateway.openai import chat, completions
from gateway.openai.decode import decode_body
from gateway.openai.results import Reply
from gateway.state import Gateway
from shared.errors import CtxfuseError, InvalidRequestError, QueueFullError
from shared.protocol import ChatCompletionRequest, CompletionRequest

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


def _salt(gw: Gateway, owner: str) -> str | None:
    return None if gw.config.share_prefix_cache else Principal(owner).cache_salt


async def _chat(gw: Gateway, raw: bytes, rid: str, priority: int, owner: str) -> bytes:
    backend = gw.backend_for_work()
    req = decode_body(raw, ChatCompletionRequest)
    gw.check_model(req.model)
    refuse_stream(req.stream)
    plan = await chat.prepare(req, backend, gw.images)
    plan.params.cache_salt = _salt(gw, owner)
    meter = gw.metrics.meter(time.monotonic())
    gen = await chat.submit(backend, plan, rid, priority)
    reply = Reply.new("chatcmpl", rid, backend, gw.texts, gw.config.log_content)
    return encode(await chat.whole_response(gen, plan, reply, meter, backend))  # it closes `gen`


async def _completion(gw: Gateway, raw: bytes, rid: str, priority: int, owner: str) -> bytes:
    backend = gw.backend_for_work()
    req = decode_body(raw, CompletionRequest)
    gw.check_model(req.model)
    refuse_stream(req.stream)
    plan = await completions.prepare(req, backend)
    plan.params.cache_salt = _salt(gw, owner)
    meter = gw.metrics.meter(time.monotonic())
    gens = await completions.submit_all(backend, plan, rid, priority)
    reply = Reply.new("cmpl", rid, backend, gw.texts, gw.config.log_content)
    return encode(await completions.whole_response(gens, plan, reply, meter, backend.tokenizer))


_ENDPOINTS = {"/v1/chat/completions": _chat, "/v1/completions": _completion}


async def execute(
    gw: Gateway,
    endpoint: str,
    raw: bytes,
    rid: str,
    priority: int = BATCH_PRIORITY,
    owner: str = DEFAULT_TENANT,
) -> Answer:
    """The route's answer to `raw`; raises QueueFullError and ServiceUnavailableError (try later)."""
    try:
        return Answer(200, await _ENDPOINTS[endpoint](gw, raw, rid, priority, owner))
    except (QueueFullError, ServiceUnavailableError):
        raise
    except CtxfuseError as exc:
        return Answer(exc.status, encode(exc.to_openai()))


def engine_executor(gw: Gateway) -> Executor:
    """The batch runner's executor for a gateway with its own engine."""
    return functools.partial(execute, gw)
