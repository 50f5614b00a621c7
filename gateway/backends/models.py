"""Several models in one gateway (`ctxfuse serve --model a=A.gguf --model b=B.gguf --alias c=b`):
one engine upstream per model, each request run by the engine of the model it names.

A request naming no model gets the first one; a name that is neither a model nor an alias is 404
`model_not_found`, listing what is served. `/v1/models` lists every model and alias with its
context. Each engine keeps its own KV budget, queue and prefix cache; /metrics sums their figures.
"""

from __future__ import annotations

import msgspec
from litestar import Response
from litestar.handlers import HTTPRouteHandler

from gateway.backends.local import EngineUpstream
from gateway.batch.executor import Answer
from gateway.encoding import encode
from gateway.openai.decode import decode_body
from gateway.state import Gateway
from gateway.upstream import Answered, AnyRequest, ChatAnswer
from shared.embeddings_protocol import EmbeddingRequest
from shared.engine_types import EngineStats, sum_tiers
from shared.errors import CtxfuseError, NotFoundError
from shared.protocol import ChatCompletionRequest, CompletionRequest
from shared.service_protocol import Model, ModelList

JSON = "application/json"


class ModelsConfigError(CtxfuseError):
    """The models and aliases given cannot be served together (a start-up error)."""


class _Named(msgspec.Struct):
    """The one field a body is dispatched by (the engine then decodes the whole body strictly)."""

    model: str | None = None


class ModelsUpstream:
    kind = "engine"

    def __init__(self, engines: list[EngineUpstream], aliases: dict[str, str] | None = None) -> None:
        if not engines:
            raise ModelsConfigError("no model to serve")
        self.engines = engines
        self.by_name: dict[str, EngineUpstream] = {}
        for e in engines:
            name = e.backend.model_name
            if name in self.by_name:
                raise ModelsConfigError(f"two models are served as {name!r}: give each its own NAME=PATH")
            self.by_name[name] = e
        for alias, target in (aliases or {}).items():
            if alias in self.by_name:
                raise ModelsConfigError(f"the alias {alias!r} is already a served model's name")
            engine = self.by_name.get(target)
            if engine is None:
                raise ModelsConfigError(f"the alias {alias!r} names {target!r}, which is not served")
            self.by_name[alias] = engine
            engine.names.add(alias)  # the engine answers to it too (its own /tokenize checks)
        self.model_name: str | None = engines[0].model_name  # for a request that names none
        self.routes: list[HTTPRouteHandler] = []

    def of(self, name: str | None) -> EngineUpstream:
        if name is None:
            return self.engines[0]
        engine = self.by_name.get(name)
        if engine is None:
            served = ", ".join(self.by_name)
            raise NotFoundError(
                f"the model `{name}` does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        return engine

    def stats(self) -> EngineStats | None:
        each = [s for s in (e.stats() for e in self.engines) if s is not None]
        if not each:
            return None
        blocks = sum(s.num_blocks for s in each)
        free = sum(s.num_free_blocks for s in each)
        return EngineStats(
            num_running=sum(s.num_running for s in each),
            num_waiting=sum(s.num_waiting for s in each),
            num_free_blocks=free,
            num_blocks=blocks,
            kv_usage=(blocks - free) / blocks if blocks else 0.0,
            kv_bytes_per_token=each[0].kv_bytes_per_token,
            prefix_queried_tokens=sum(s.prefix_queried_tokens for s in each),
            prefix_hit_tokens=sum(s.prefix_hit_tokens for s in each),
            grammar_cache_hits=sum(s.grammar_cache_hits for s in each),
            grammar_cache_misses=sum(s.grammar_cache_misses for s in each),
            kv_tiers=sum_tiers([t for s in each for t in s.kv_tiers]),
            spec_draft_tokens=sum(s.spec_draft_tokens for s in each),
            spec_accepted_tokens=sum(s.spec_accepted_tokens for s in each),
            kv_dtype=",".join(sorted({s.kv_dtype for s in each})),
        )

    def dead_reason(self) -> str | None:
        # one engine gone is a process to restart: its requests could never be answered here again
        return next((r for r in (e.dead_reason() for e in self.engines) if r is not None), None)

    def not_ready_reason(self) -> str | None:
        return None

    def check_model(self, name: str | None) -> None:
        self.of(name)

    async def start(self) -> None:
        for e in self.engines:
            await e.start()

    async def stop(self) -> None:
        for e in self.engines:
            await e.stop()

    async def chat(
        self, request: AnyRequest, gw: Gateway, req: ChatCompletionRequest, raw: bytes, arrival: float
    ) -> ChatAnswer:
        return await self.of(req.model).chat(request, gw, req, raw, arrival)

    async def completion(
        self, request: AnyRequest, gw: Gateway, req: CompletionRequest, raw: bytes, arrival: float
    ) -> Answered:
        return await self.of(req.model).completion(request, gw, req, raw, arrival)

    async def embeddings(
        self, request: AnyRequest, gw: Gateway, req: EmbeddingRequest, raw: bytes, arrival: float
    ) -> Answered:
        return await self.of(req.model).embeddings(request, gw, req, raw, arrival)

    def _listed(self, gw: Gateway, name: str) -> Model:
        b = self.by_name[name].backend
        return Model(id=name, created=gw.created, max_model_len=b.max_model_len)

    async def models(self, request: AnyRequest, gw: Gateway) -> Response[bytes]:
        listed = ModelList(data=[self._listed(gw, name) for name in self.by_name])
        return Response(encode(listed), media_type=JSON)

    async def model(self, request: AnyRequest, gw: Gateway, model_id: str) -> Response[bytes]:
        self.of(model_id)
        return Response(encode(self._listed(gw, model_id)), media_type=JSON)

    async def tokenize(self, request: AnyRequest, gw: Gateway, raw: bytes) -> Answered:
        return await self.of(_model_of(raw)).tokenize(request, gw, raw)

    async def detokenize(self, request: AnyRequest, gw: Gateway, raw: bytes) -> Answered:
        return await self.of(_model_of(raw)).detokenize(request, gw, raw)

    async def execute(
        self, gw: Gateway, endpoint: str, raw: bytes, rid: str, priority: int, owner: str
    ) -> Answer:
        try:
            engine = self.of(_model_of(raw))
        except CtxfuseError as exc:  # the line's own mistake: its answer, as the route would give it
            return Answer(exc.status, encode(exc.to_openai()))
        return await engine.execute(gw, endpoint, raw, rid, priority, owner)


def _model_of(raw: bytes) -> str | None:
    """The model a body names; a body that is not an object is refused by its own route's decoding."""
    try:
        return msgspec.json.decode(raw, type=_Named).model
    except (msgspec.DecodeError, msgspec.ValidationError):
        return decode_body(raw, _Named).model  # the route's own 400 for a body that is no JSON object
