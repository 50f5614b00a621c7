"""The OpenAI-compatible routes: thin handlers that decode, plan, submit and hand over to the chat and
completions modules. Bodies are decoded here (strictly, see openai/decode.py), not by Litestar."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.params import FromPath

from gateway.access.auth import principal_of, reserve_tokens
from gateway.access.limits import SettleOnClose
from gateway.backends.engine import Generation
from gateway.encoding import encode
from gateway.openai import chat, chat_stream, completions
from gateway.openai.decode import decode_body
from gateway.openai.disconnect import cancel_on_disconnect
from gateway.openai.results import Reply
from gateway.openai.sse import sse_stream
from gateway.ops.observe import annotate, request_id
from gateway.state import Gateway
from shared.errors import InvalidRequestError
from shared.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    Model,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

JSON = "application/json"
AnyRequest = Request[Any, Any, Any]


def gateway_of(request: AnyRequest) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _json(obj: object) -> Response[bytes]:
    return Response(encode(obj), media_type=JSON)


def _annotate_request(gw: Gateway, req: chat.ChatCompletionRequest | CompletionRequest) -> None:
    annotate(model=req.model, stream=req.stream, n=req.n)
    if req.user is not None:
        annotate(user=req.user)
    if gw.config.log_content:
        body = req.messages if isinstance(req, ChatCompletionRequest) else req.prompt
        annotate(prompt=msgspec.to_builtins(body))


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion (OpenAI)")
async def chat_completions(request: AnyRequest) -> Response[Any]:
    arrival = time.monotonic()
    return await serve_chat(request, await request.body(), arrival)


async def serve_chat(request: AnyRequest, raw: bytes, arrival: float) -> Response[Any]:
    """A chat completion for the JSON body `raw` (from the route, or reassembled from the edge link)."""
    gw = gateway_of(request)
    backend = gw.backend_for_work()
    req = decode_body(raw, ChatCompletionRequest)
    gw.check_model(req.model)
    principal_of(request.state).check_model(req.model or gw.backend.model_name)
    _annotate_request(gw, req)
    plan = await chat.prepare(req, backend, gw.images)
    prompt = len(plan.prompt_ids)
    settle = _reserve(request, gw, prompt, prompt + plan.params.n * plan.params.max_tokens)
    plan.params.cache_salt = _cache_salt(request, gw)
    rid = request_id()
    meter = gw.metrics.meter(arrival)
    gen = await chat.submit(backend, plan, rid)
    if settle is not None:
        gen = settle.wrap(gen)
    reply = Reply.new("chatcmpl", rid, backend, gw.texts, gw.config.log_content)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        stream = sse_stream(chat_stream.stream_response(gen, plan, reply, meter, include_usage, backend))
        stream.background = _closer(gen)  # in case the body never starts (client gone first)
        return stream
    try:
        body = await cancel_on_disconnect(
            request.receive, chat.whole_response(gen, plan, reply, meter, backend)
        )
    finally:
        gen.close()
    return _json(body)


@post("/v1/completions", status_code=200, summary="Create a completion (OpenAI, legacy)")
async def create_completion(request: AnyRequest) -> Response[Any]:
    arrival = time.monotonic()
    return await serve_completion(request, await request.body(), arrival)


async def serve_completion(request: AnyRequest, raw: bytes, arrival: float) -> Response[Any]:
    """A legacy completion for the JSON body `raw` (from the route, or reassembled from the edge link)."""
    gw = gateway_of(request)
    backend = gw.backend_for_work()
    req = decode_body(raw, CompletionRequest)
    gw.check_model(req.model)
    principal_of(request.state).check_model(req.model or gw.backend.model_name)
    _annotate_request(gw, req)
    plan = await completions.prepare(req, backend)
    prompt = sum(len(p) for p in plan.prompts)
    most = prompt + len(plan.prompts) * plan.params.n * plan.params.max_tokens
    settle = _reserve(request, gw, prompt, most)
    plan.params.cache_salt = _cache_salt(request, gw)
    rid = request_id()
    meter = gw.metrics.meter(arrival)
    gens = await completions.submit_all(backend, plan, rid)
    if settle is not None:
        gens = [settle.wrap(g) for g in gens]
    reply = Reply.new("cmpl", rid, backend, gw.texts, gw.config.log_content)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        stream = sse_stream(
            completions.stream_response(gens, plan, reply, meter, include_usage, backend.tokenizer)
        )
        stream.background = _closer(*gens)
        return stream
    try:
        body = await cancel_on_disconnect(
            request.receive, completions.whole_response(gens, plan, reply, meter, backend.tokenizer)
        )
    finally:
        for g in gens:
            g.close()
    return _json(body)


def _reserve(request: AnyRequest, gw: Gateway, prompt_tokens: int, most_tokens: int) -> SettleOnClose | None:
    """Reserve the request's most tokens against its key's tokens per minute (429 when they do not
    fit); what settles the reservation to the real count when its generations close."""
    ticket = reserve_tokens(request.state, gw.limiter, most_tokens)
    return None if ticket is None else SettleOnClose(gw.limiter, ticket, prompt_tokens)


def _cache_salt(request: AnyRequest, gw: Gateway) -> str | None:
    """Each tenant's prompts reuse only its own cached prefixes, unless the server shares them."""
    return None if gw.config.share_prefix_cache else principal_of(request.state).cache_salt


def _closer(*gens: Generation) -> BackgroundTask:
    def close() -> None:
        for g in gens:
            g.close()

    return BackgroundTask(close)


def _model(gw: Gateway) -> Model:
    b = gw.backend
    return Model(id=b.model_name, created=gw.created, max_model_len=b.max_model_len)


@get("/v1/models", summary="List models")
async def list_models(request: AnyRequest) -> Response[bytes]:
    return _json(ModelList(data=[_model(gateway_of(request))]))


@get("/v1/models/{model_id:path}", summary="Retrieve a model")
async def retrieve_model(request: AnyRequest, model_id: FromPath[str]) -> Response[bytes]:
    gw = gateway_of(request)
    gw.check_model(model_id.lstrip("/"))
    return _json(_model(gw))


@post("/tokenize", status_code=200, summary="Token ids of a prompt or of chat messages")
async def tokenize(request: AnyRequest) -> Response[bytes]:
    gw = gateway_of(request)
    req = decode_body(await request.body(), TokenizeRequest)
    gw.check_model(req.model)
    backend = gw.backend
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("send exactly one of `prompt` and `messages`", param="prompt")
    if req.messages is not None:
        await gw.images.resolve(req.messages)
        messages = chat.message_dicts(req.messages)
        ids = (await asyncio.to_thread(backend.encode_chat, messages)).token_ids  # never on the loop
    else:
        ids = await asyncio.to_thread(backend.tokenizer.encode, req.prompt or "", req.add_special_tokens)
    return _json(TokenizeResponse(count=len(ids), max_model_len=backend.max_model_len, tokens=ids))


@post("/detokenize", status_code=200, summary="Text of token ids")
async def detokenize(request: AnyRequest) -> Response[bytes]:
    gw = gateway_of(request)
    req = decode_body(await request.body(), DetokenizeRequest)
    gw.check_model(req.model)
    vocab = gw.backend.tokenizer.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens"
        )
    text = await asyncio.to_thread(gw.backend.tokenizer.decode, req.tokens)
    return _json(DetokenizeResponse(prompt=text))


ROUTES = [chat_completions, create_completion, list_models, retrieve_model, tokenize, detokenize]
