"""The engine as the gateway's upstream (`ctxfuse serve`, `ctxfuse worker`): requests are planned
(templated, tokenized, constrained) here and run by the engine behind `Backend` (gateway/seam.py),
in this process or in a child process (cloud/serving/).

The app has already authenticated the caller, checked its limits and allowed models and decoded the
body; this module plans, reserves the request's tokens, submits and hands over to the chat and
completions modules (openai/). A worker also serves the internal routes its router reads
(backends/worker.py).
"""

from __future__ import annotations

import asyncio
import time

from litestar import Response
from litestar.background_tasks import BackgroundTask
from litestar.handlers import HTTPRouteHandler

from gateway.access.auth import Principal, principal_of, reserve_settled, reserve_tokens
from gateway.backends.worker import ROUTES as WORKER_ROUTES
from gateway.backends.worker import WorkerEngine
from gateway.batch.executor import Answer, refuse_stream
from gateway.config import GatewayConfig
from gateway.edge.chunk_store import ChunkStore
from gateway.encoding import encode
from gateway.errors import ServiceUnavailableError
from gateway.openai import chat, chat_stream, completions, embeddings
from gateway.openai.decode import decode_body
from gateway.openai.disconnect import cancel_on_disconnect
from gateway.openai.images import Images
from gateway.openai.logprobs import TokenTexts
from gateway.openai.results import Reply
from gateway.openai.sse import sse_stream
from gateway.ops.observe import request_id
from gateway.seam import Backend, Generation
from gateway.state import Gateway
from gateway.upstream import CHAT_PATH, COMPLETIONS_PATH, Answered, AnyRequest
from shared.embeddings_protocol import EMBEDDINGS_PATH, EmbeddingRequest
from shared.engine_types import EngineStats
from shared.errors import CtxfuseError, InvalidRequestError, NotFoundError, QueueFullError
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
# the open requests' errors say why it stopped (the exit code, the exception); the log has the rest
ENGINE_DEAD = "the engine has stopped; the server must be restarted"


def _json(obj: object) -> Response[bytes]:
    return Response(encode(obj), media_type=JSON)


def _closer(*gens: Generation) -> BackgroundTask:
    def close() -> None:
        for g in gens:
            g.close()

    return BackgroundTask(close)


class EngineUpstream:
    kind = "engine"

    def __init__(self, backend: Backend, config: GatewayConfig, worker: WorkerEngine | None = None) -> None:
        self.backend = backend
        self.model_name: str | None = backend.model_name
        self.names = {backend.model_name}  # and its aliases, when several models are served (models.py)
        self.share_prefix_cache = config.share_prefix_cache
        self.embedding_token_ids = config.embedding_token_ids
        self.log_content = config.log_content
        self.texts = TokenTexts(backend.tokenizer)
        self.images = Images(config.vision)  # image parts -> features, built on the first image
        self.worker = worker  # `ctxfuse worker`: what its internal routes read
        self.routes: list[HTTPRouteHandler] = list(WORKER_ROUTES) if worker is not None else []

    # -- state ---------------------------------------------------------------------------------

    def stats(self) -> EngineStats | None:
        return self.backend.stats()

    def dead_reason(self) -> str | None:
        # a dead engine never recovers in this process: 503 tells a supervisor or the fleet router to
        # restart or route around it (vLLM answers the same)
        return None if self.backend.is_alive() else ENGINE_DEAD

    def not_ready_reason(self) -> str | None:
        return None

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise NotFoundError(
                f"the model `{name}` does not exist; this server serves `{self.backend.model_name}`",
                param="model",
                code="model_not_found",
            )

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        await self.images.close()

    def _cache_salt(self, tenant_salt: str | None) -> str | None:
        """Each tenant's prompts reuse only its own cached prefixes, unless the server shares them."""
        return None if self.share_prefix_cache else tenant_salt

    # -- live requests -------------------------------------------------------------------------

    async def chat(
        self, request: AnyRequest, gw: Gateway, req: ChatCompletionRequest, raw: bytes, arrival: float
    ) -> Answered:
        backend = self.backend
        plan = await chat.prepare(req, backend, self.images)
        prompt = len(plan.prompt_ids)
        settle = reserve_settled(
            request.state, gw.limiter, prompt, prompt + plan.params.n * plan.params.max_tokens
        )
        plan.params.cache_salt = self._cache_salt(principal_of(request.state).cache_salt)
        rid = request_id()
        meter = gw.metrics.meter(arrival)
        gen = await chat.submit(backend, plan, rid)
        if settle is not None:
            gen = settle.wrap(gen)
        reply = Reply.new("chatcmpl", rid, backend, self.texts, self.log_content)
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

    async def completion(
        self, request: AnyRequest, gw: Gateway, req: CompletionRequest, raw: bytes, arrival: float
    ) -> Answered:
        backend = self.backend
        plan = await completions.prepare(req, backend)
        prompt = sum(len(p) for p in plan.prompts)
        most = prompt + len(plan.prompts) * plan.params.n * plan.params.max_tokens
        settle = reserve_settled(request.state, gw.limiter, prompt, most)
        plan.params.cache_salt = self._cache_salt(principal_of(request.state).cache_salt)
        rid = request_id()
        meter = gw.metrics.meter(arrival)
        gens = await completions.submit_all(backend, plan, rid)
        if settle is not None:
            gens = [settle.wrap(g) for g in gens]
        reply = Reply.new("cmpl", rid, backend, self.texts, self.log_content)
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

    async def embeddings(
        self, request: AnyRequest, gw: Gateway, req: EmbeddingRequest, raw: bytes, arrival: float
    ) -> Answered:
        inputs = await embeddings.prepare(req, self.backend, self.embedding_token_ids)
        # the exact count is known: what is reserved is what is used, unless the work never ran
        ticket = reserve_tokens(request.state, gw.limiter, sum(len(ids) for ids in inputs))
        try:
            body = await cancel_on_disconnect(
                request.receive, embeddings.embed(req, self.backend, inputs, request_id())
            )
        except BaseException:
            if ticket is not None:
                gw.limiter.settle(ticket, 0)
            raise
        return _json(body)

    # -- models and tokens ---------------------------------------------------------------------

    def _model(self, gw: Gateway) -> Model:
        b = self.backend
        return Model(id=b.model_name, created=gw.created, max_model_len=b.max_model_len)

    async def models(self, request: AnyRequest, gw: Gateway) -> Response[bytes]:
        return _json(ModelList(data=[self._model(gw)]))

    async def model(self, request: AnyRequest, gw: Gateway, model_id: str) -> Response[bytes]:
        self.check_model(model_id)
        return _json(self._model(gw))

    async def tokenize(self, request: AnyRequest, gw: Gateway, raw: bytes) -> Answered:
        req = decode_body(raw, TokenizeRequest)
        self.check_model(req.model)
        backend = self.backend
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("send exactly one of `prompt` and `messages`", param="prompt")
        if req.messages is not None:
            await self.images.resolve(req.messages)
            messages = chat.message_dicts(req.messages)
            ids = (await asyncio.to_thread(backend.encode_chat, messages)).token_ids  # never on the loop
        else:
            ids = await asyncio.to_thread(backend.tokenizer.encode, req.prompt or "", req.add_special_tokens)
        return _json(TokenizeResponse(count=len(ids), max_model_len=backend.max_model_len, tokens=ids))

    async def detokenize(self, request: AnyRequest, gw: Gateway, raw: bytes) -> Answered:
        req = decode_body(raw, DetokenizeRequest)
        self.check_model(req.model)
        vocab = self.backend.tokenizer.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens"
            )
        text = await asyncio.to_thread(self.backend.tokenizer.decode, req.tokens)
        return _json(DetokenizeResponse(prompt=text))

    # -- batch requests ------------------------------------------------------------------------

    async def execute(
        self, gw: Gateway, endpoint: str, raw: bytes, rid: str, priority: int, owner: str
    ) -> Answer:
        try:
            gw.check_taking_work()
            if endpoint == CHAT_PATH:
                body = await self._batch_chat(gw, raw, rid, priority, owner)
            elif endpoint == COMPLETIONS_PATH:
                body = await self._batch_completion(gw, raw, rid, priority, owner)
            elif endpoint == EMBEDDINGS_PATH:
                body = await self._batch_embeddings(raw, rid)
            else:
                raise InvalidRequestError(f"{endpoint} is not served in a batch", param="endpoint")
            return Answer(200, body)
        except (QueueFullError, ServiceUnavailableError):
            raise
        except CtxfuseError as exc:
            return Answer(exc.status, encode(exc.to_openai()))

    def _owner_salt(self, owner: str) -> str | None:
        return self._cache_salt(Principal(owner).cache_salt)

    async def _batch_chat(self, gw: Gateway, raw: bytes, rid: str, priority: int, owner: str) -> bytes:
        backend = self.backend
        req = decode_body(raw, ChatCompletionRequest)
        self.check_model(req.model)
        refuse_stream(req.stream)
        plan = await chat.prepare(req, backend, self.images)
        plan.params.cache_salt = self._owner_salt(owner)  # the batch owner's partition
        meter = gw.metrics.meter(time.monotonic())
        gen = await chat.submit(backend, plan, rid, priority)
        reply = Reply.new("chatcmpl", rid, backend, self.texts, self.log_content)
        return encode(await chat.whole_response(gen, plan, reply, meter, backend))  # it closes `gen`

    async def _batch_completion(self, gw: Gateway, raw: bytes, rid: str, priority: int, owner: str) -> bytes:
        backend = self.backend
        req = decode_body(raw, CompletionRequest)
        self.check_model(req.model)
        refuse_stream(req.stream)
        plan = await completions.prepare(req, backend)
        plan.params.cache_salt = self._owner_salt(owner)
        meter = gw.metrics.meter(time.monotonic())
        gens = await completions.submit_all(backend, plan, rid, priority)
        reply = Reply.new("cmpl", rid, backend, self.texts, self.log_content)
        return encode(await completions.whole_response(gens, plan, reply, meter, backend.tokenizer))

    async def _batch_embeddings(self, raw: bytes, rid: str) -> bytes:
        req = decode_body(raw, EmbeddingRequest)
        self.check_model(req.model)
        inputs = await embeddings.prepare(req, self.backend, self.embedding_token_ids)
        return encode(await embeddings.embed(req, self.backend, inputs, rid))


def engine_gateway(
    backend: Backend,
    config: GatewayConfig,
    chunk_store: ChunkStore | None = None,
    worker: WorkerEngine | None = None,
) -> Gateway:
    """The gateway's state over an engine (`chunk_store`: the edge link's, when it listens)."""
    return Gateway(EngineUpstream(backend, config, worker), config, chunk_store)
