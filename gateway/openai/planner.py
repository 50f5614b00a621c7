"""The OpenAI work over any engine behind the seam (gateway/seam.py): plan a request (template,
tokenize, constrain), reserve its tokens against the key's minute, put it in the tenant's prefix-cache
partition, submit it, answer whole or streamed, settle what it used, and abort it when the client
goes. Written once, for every backend: the engine in this process or in its child process
(backends/local.py) and the fleet's workers over HTTP (backends/fleet/engine.py).

The app has already authenticated the caller, checked its limits and allowed models and decoded the
body (app.py); `check_model` says whether the backend serves the model a request names.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from litestar import Response
from litestar.background_tasks import BackgroundTask

from gateway.access.auth import Principal, principal_of, reserve_settled, reserve_tokens
from gateway.access.limits import SettleOnClose
from gateway.batch.executor import Answer, refuse_stream
from gateway.config import GatewayConfig
from gateway.encoding import encode
from gateway.errors import ServiceUnavailableError
from gateway.openai import chat, chat_stream, completions, embeddings
from gateway.openai.decode import decode_body
from gateway.openai.images import Images
from gateway.openai.logprobs import TokenTexts
from gateway.openai.results import Reply
from gateway.openai.sse import sse_stream
from gateway.ops.observe import request_id
from gateway.seam import Backend, Generation
from gateway.state import Gateway
from gateway.upstream import CHAT_PATH, COMPLETIONS_PATH, Answered, AnyRequest, ChatAnswer
from shared.disconnect import cancel_on_disconnect
from shared.embeddings_protocol import EMBEDDINGS_PATH, EmbeddingRequest
from shared.errors import CtxfuseError, InvalidRequestError, QueueFullError
from shared.protocol import ChatCompletionRequest, CompletionRequest
from shared.service_protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse

JSON = "application/json"
CheckModel = Callable[[str | None], None]
T = TypeVar("T")


def json_response(obj: object) -> Response[bytes]:
    return Response(encode(obj), media_type=JSON)


def render_chat(answer: ChatAnswer) -> Answered:
    """The HTTP response to a chat completion: JSON, server-sent events, or as relayed."""
    if answer.relayed is not None:
        return answer.relayed
    out: Answered
    if answer.chunks is not None:
        out = sse_stream(chat_stream.sse_chunks(answer.chunks))
        out.background = _closer(answer)  # in case the body never starts (client gone first)
    else:
        out = json_response(answer.whole)
    for name, value in answer.headers.items():
        out.headers[name] = value
    return out


async def _taken(settle: SettleOnClose | None, submitting: Awaitable[T]) -> T:
    """What `submitting` returns; a request the engine did not take is charged nothing."""
    try:
        return await submitting
    except BaseException:
        if settle is not None:
            settle.nothing_used()
        raise


def _closer(*gens: Generation | ChatAnswer) -> BackgroundTask:
    async def close() -> None:  # on the loop, not in a thread
        for g in gens:
            g.close()

    return BackgroundTask(close)


class Planner:
    def __init__(self, config: GatewayConfig) -> None:
        self.share_prefix_cache = config.share_prefix_cache
        self.embedding_token_ids = config.embedding_token_ids
        self.log_content = config.log_content
        self.images = Images(config.vision)  # image parts -> features, built on the first image
        self._texts: tuple[object, TokenTexts] | None = None  # (its tokenizer, the texts)

    async def close(self) -> None:
        await self.images.close()

    def _reply(self, kind: str, rid: str, backend: Backend) -> Reply:
        if self._texts is None or self._texts[0] is not backend.tokenizer:  # the fleet's comes late
            self._texts = (backend.tokenizer, TokenTexts(backend.tokenizer))
        return Reply.new(kind, rid, backend, self._texts[1], self.log_content)

    def cache_salt(self, tenant_salt: str | None) -> str | None:
        """Each tenant's prompts reuse only its own cached prefixes, unless the server shares them."""
        return None if self.share_prefix_cache else tenant_salt

    # -- live requests -------------------------------------------------------------------------

    async def chat(
        self, request: AnyRequest, gw: Gateway, backend: Backend, req: ChatCompletionRequest, arrival: float
    ) -> ChatAnswer:
        plan = await chat.prepare(req, backend, self.images)
        prompt = len(plan.prompt_ids)
        settle = await reserve_settled(
            request.state, gw.limiter, prompt, prompt + plan.params.n * plan.params.max_tokens
        )
        plan.params.cache_salt = self.cache_salt(principal_of(request.state).cache_salt)
        rid = request_id()
        meter = gw.metrics.meter(arrival, principal_of(request.state).tenant)
        gen = await _taken(settle, chat.submit(backend, plan, rid))
        if settle is not None:
            gen = settle.wrap(gen)
        reply = self._reply("chatcmpl", rid, backend)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            chunks = chat_stream.chunks(gen, plan, reply, meter, include_usage, backend)
            return ChatAnswer(chunks=chunks, close=gen.close)
        try:
            body = await cancel_on_disconnect(
                request.receive, chat.whole_response(gen, plan, reply, meter, backend)
            )
        finally:
            gen.close()
        return ChatAnswer(whole=body)

    async def completion(
        self, request: AnyRequest, gw: Gateway, backend: Backend, req: CompletionRequest, arrival: float
    ) -> Answered:
        plan = await completions.prepare(req, backend)
        prompt = sum(len(p) for p in plan.prompts)
        most = prompt + len(plan.prompts) * plan.params.n * plan.params.max_tokens
        settle = await reserve_settled(request.state, gw.limiter, prompt, most)
        plan.params.cache_salt = self.cache_salt(principal_of(request.state).cache_salt)
        rid = request_id()
        meter = gw.metrics.meter(arrival, principal_of(request.state).tenant)
        gens = await _taken(settle, completions.submit_all(backend, plan, rid))
        if settle is not None:
            gens = [settle.wrap(g) for g in gens]
        reply = self._reply("cmpl", rid, backend)
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
        return json_response(body)

    async def embeddings(
        self, request: AnyRequest, gw: Gateway, backend: Backend, req: EmbeddingRequest
    ) -> Answered:
        inputs = await embeddings.prepare(req, backend, self.embedding_token_ids)
        # the exact count is known: what is reserved is what is used, unless the work never ran
        ticket = await reserve_tokens(request.state, gw.limiter, sum(len(ids) for ids in inputs))
        try:
            body = await cancel_on_disconnect(
                request.receive, embeddings.embed(req, backend, inputs, request_id())
            )
        except BaseException:
            if ticket is not None:
                gw.limiter.settle(ticket, 0)
            raise
        return json_response(body)

    # -- tokens ----------------------------------------------------------------------------------

    async def tokenize(self, backend: Backend, check_model: CheckModel, raw: bytes) -> Answered:
        req = decode_body(raw, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("send exactly one of `prompt` and `messages`", param="prompt")
        if req.messages is not None:
            await self.images.resolve(req.messages)
            messages = chat.message_dicts(req.messages)
            ids = (await asyncio.to_thread(backend.encode_chat, messages)).token_ids  # never on the loop
        else:
            ids = await asyncio.to_thread(backend.tokenizer.encode, req.prompt or "", req.add_special_tokens)
        return json_response(
            TokenizeResponse(count=len(ids), max_model_len=backend.max_model_len, tokens=ids)
        )

    async def detokenize(self, backend: Backend, check_model: CheckModel, raw: bytes) -> Answered:
        req = decode_body(raw, DetokenizeRequest)
        check_model(req.model)
        vocab = backend.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens"
            )
        text = await asyncio.to_thread(backend.tokenizer.decode, req.tokens)
        return json_response(DetokenizeResponse(prompt=text))

    # -- batch requests ------------------------------------------------------------------------

    async def execute(
        self,
        gw: Gateway,
        backend: Backend,
        check_model: CheckModel,
        endpoint: str,
        raw: bytes,
        rid: str,
        priority: int,
        owner: str,
    ) -> Answer:
        """One batch request, answered as its route would answer it, run as the batch's owner;
        raises QueueFullError or ServiceUnavailableError when it cannot be taken now (the runner
        tries again later)."""
        try:
            gw.check_taking_work()
            if endpoint == CHAT_PATH:
                body = await self._batch_chat(gw, backend, check_model, raw, rid, priority, owner)
            elif endpoint == COMPLETIONS_PATH:
                body = await self._batch_completion(gw, backend, check_model, raw, rid, priority, owner)
            elif endpoint == EMBEDDINGS_PATH:
                body = await self._batch_embeddings(backend, check_model, raw, rid)
            else:
                raise InvalidRequestError(f"{endpoint} is not served in a batch", param="endpoint")
            return Answer(200, body)
        except (QueueFullError, ServiceUnavailableError):
            raise
        except CtxfuseError as exc:
            return Answer(exc.status, encode(exc.to_openai()))

    def _owner_salt(self, owner: str) -> str | None:
        return self.cache_salt(Principal(owner).cache_salt)  # the batch owner's partition

    async def _batch_chat(
        self,
        gw: Gateway,
        backend: Backend,
        check_model: CheckModel,
        raw: bytes,
        rid: str,
        priority: int,
        owner: str,
    ) -> bytes:
        req = decode_body(raw, ChatCompletionRequest)
        check_model(req.model)
        refuse_stream(req.stream)
        plan = await chat.prepare(req, backend, self.images)
        plan.params.cache_salt = self._owner_salt(owner)
        meter = gw.metrics.meter(time.monotonic(), owner)
        gen = await chat.submit(backend, plan, rid, priority)
        reply = self._reply("chatcmpl", rid, backend)
        return encode(await chat.whole_response(gen, plan, reply, meter, backend))  # it closes `gen`

    async def _batch_completion(
        self,
        gw: Gateway,
        backend: Backend,
        check_model: CheckModel,
        raw: bytes,
        rid: str,
        priority: int,
        owner: str,
    ) -> bytes:
        req = decode_body(raw, CompletionRequest)
        check_model(req.model)
        refuse_stream(req.stream)
        plan = await completions.prepare(req, backend)
        plan.params.cache_salt = self._owner_salt(owner)
        meter = gw.metrics.meter(time.monotonic(), owner)
        gens = await completions.submit_all(backend, plan, rid, priority)
        reply = self._reply("cmpl", rid, backend)
        return encode(await completions.whole_response(gens, plan, reply, meter, backend.tokenizer))

    async def _batch_embeddings(
        self, backend: Backend, check_model: CheckModel, raw: bytes, rid: str
    ) -> bytes:
        req = decode_body(raw, EmbeddingRequest)
        check_model(req.model)
        inputs = await embeddings.prepare(req, backend, self.embedding_token_ids)
        return encode(await embeddings.embed(req, backend, inputs, rid))
