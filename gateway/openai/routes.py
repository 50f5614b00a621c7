"""The OpenAI-compatible routes, once for every upstream (gateway/upstream.py): thin handlers that
decode the body strictly (decode.py, not Litestar), check the model against the upstream and the
caller's key, log what was asked, and hand the request to the upstream that answers it."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.params import FromPath

from gateway.access.auth import principal_of
from gateway.openai.decode import decode_body
from gateway.openai.planner import render_chat
from gateway.ops.observe import annotate
from gateway.state import Gateway
from gateway.upstream import CHAT_PATH, COMPLETIONS_PATH, Answered, ChatAnswer
from shared.embeddings_protocol import EMBEDDINGS_PATH, EmbeddingRequest
from shared.protocol import ChatCompletionRequest, CompletionRequest

AnyRequest = Request[Any, Any, Any]


def gateway_of(request: AnyRequest) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


def _annotate_request(gw: Gateway, req: ChatCompletionRequest | CompletionRequest) -> None:
    annotate(model=req.model, stream=req.stream, n=req.n)
    if req.user is not None:
        annotate(user=req.user)
    if gw.config.log_content:
        body = req.messages if isinstance(req, ChatCompletionRequest) else req.prompt
        annotate(prompt=msgspec.to_builtins(body))


async def answer(request: AnyRequest, path: str, raw: bytes, arrival: float) -> Answered:
    """A chat completion or a completion for the JSON body `raw` (from the route, or put back
    together from the edge link), answered by the gateway's upstream."""
    if path == CHAT_PATH:
        req = decode_body(raw, ChatCompletionRequest)
        return render_chat(await chat_answer(request, req, raw, arrival))
    completion = decode_body(raw, CompletionRequest)
    gw = _admit(request, completion)
    return await gw.upstream.completion(request, gw, completion, raw, arrival)


async def chat_answer(
    request: AnyRequest, req: ChatCompletionRequest, raw: bytes, arrival: float
) -> ChatAnswer:
    """The upstream's answer to a decoded chat request (`raw`: its JSON body, for a relay)."""
    gw = _admit(request, req)
    return await gw.upstream.chat(request, gw, req, raw, arrival)


def _admit(request: AnyRequest, req: ChatCompletionRequest | CompletionRequest) -> Gateway:
    """The checks every chat and completion passes before its upstream sees it."""
    gw = gateway_of(request)
    gw.check_taking_work()
    gw.upstream.check_model(req.model)
    principal_of(request.state).check_model(req.model or gw.upstream.model_name)
    _annotate_request(gw, req)
    return gw


@post(CHAT_PATH, status_code=200, summary="Create a chat completion (OpenAI)")
async def chat_completions(request: AnyRequest) -> Answered:
    arrival = time.monotonic()
    return await answer(request, CHAT_PATH, await request.body(), arrival)


@post(COMPLETIONS_PATH, status_code=200, summary="Create a completion (OpenAI, legacy)")
async def create_completion(request: AnyRequest) -> Answered:
    arrival = time.monotonic()
    return await answer(request, COMPLETIONS_PATH, await request.body(), arrival)


@post(EMBEDDINGS_PATH, status_code=200, summary="Create embeddings (OpenAI)")
async def create_embeddings(request: AnyRequest) -> Answered:
    arrival = time.monotonic()
    gw = gateway_of(request)
    gw.check_taking_work()
    raw = await request.body()
    req = decode_body(raw, EmbeddingRequest)
    gw.upstream.check_model(req.model)
    principal_of(request.state).check_model(req.model)
    annotate(model=req.model)
    if req.user is not None:
        annotate(user=req.user)
    return await gw.upstream.embeddings(request, gw, req, raw, arrival)


@get("/v1/models", summary="List models")
async def list_models(request: AnyRequest) -> Response[bytes]:
    gw = gateway_of(request)
    return await gw.upstream.models(request, gw)


@get("/v1/models/{model_id:path}", summary="Retrieve a model")
async def retrieve_model(request: AnyRequest, model_id: FromPath[str]) -> Response[bytes]:
    gw = gateway_of(request)
    return await gw.upstream.model(request, gw, model_id.lstrip("/"))


@post("/tokenize", status_code=200, summary="Token ids of a prompt or of chat messages")
async def tokenize(request: AnyRequest) -> Answered:
    gw = gateway_of(request)
    return await gw.upstream.tokenize(request, gw, await request.body())


@post("/detokenize", status_code=200, summary="Text of token ids")
async def detokenize(request: AnyRequest) -> Answered:
    gw = gateway_of(request)
    return await gw.upstream.detokenize(request, gw, await request.body())


ROUTES = [
    chat_completions,
    create_completion,
    create_embeddings,
    list_models,
    retrieve_model,
    tokenize,
    detokenize,
]
