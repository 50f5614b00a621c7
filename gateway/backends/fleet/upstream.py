"""The fleet as the gateway's upstream (`ctxfuse serve --backend URL ...` / `--fleet fleet.toml`):
the one app (gateway/app.py) authenticates, limits, decodes and logs each request as it does over an
engine; this module routes what got through to the backend that holds its prompt's prefix.

- Over ctxfuse workers (every backend one, serving the model whose text side the router holds):
  chat, completions, embeddings and batch requests are planned here by the same planner as over a
  local engine (openai/planner.py), and the workers run them behind the engine seam (engine.py).
  Chats with image_url parts go as sent: the worker turns the images into features.
- Over other OpenAI-compatible servers (or a fleet that mixes them in): chat and completions go
  where their prefix keys point (policy.py), the body as the client sent it (proxy.py), in the
  caller's tenant's prefix-cache partition unless the fleet shares one. A key with tokens per minute
  reserves prompt + max_tokens first and settles to the usage the backend reports (usage.py).
  Embeddings: the least loaded backend serving the named model answers; a key with tokens per
  minute reserves the body's length (no input has more tokens than bytes in its JSON) up to its
  minute, settled to the usage the backend reports.
- `/tokenize`, `/detokenize` and `/v1/models/{id}` are answered by a backend (the least loaded, for
  the first two). The Files and Batch API is the gateway's own; its requests are routed like live
  ones (batch.py).
- `GET /fleet/v1/backends` shows what the router knows: each backend's kind, version, circuit, load,
  prefix keys, and the canary's state.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import msgspec
from litestar import Response, get
from litestar.handlers import HTTPRouteHandler

from gateway.access.auth import Principal, principal_of, reserve_tokens
from gateway.backends.fleet.batch import execute_routed
from gateway.backends.fleet.engine import FleetEngine
from gateway.backends.fleet.fleet import Fleet
from gateway.backends.fleet.health import check_all, run_checks
from gateway.backends.fleet.keys import RequestKeys
from gateway.backends.fleet.proxy import BACKEND_HEADER, VERSION_HEADER, Outgoing, forward
from gateway.backends.fleet.usage import Settle, most_tokens, with_usage
from gateway.batch.executor import Answer
from gateway.config import GatewayConfig
from gateway.encoding import encode
from gateway.errors import ServiceUnavailableError
from gateway.openai.planner import Planner
from gateway.state import Gateway
from gateway.upstream import Answered, AnyRequest, ChatAnswer
from shared.block_hash import salt_key
from shared.disconnect import cancel_on_disconnect
from shared.embeddings_protocol import EMBEDDINGS_PATH, EmbeddingRequest
from shared.engine_types import EngineStats
from shared.forwarded_path import forwarded_path
from shared.protocol import ChatCompletionRequest, CompletionRequest

JSON = "application/json"


class FleetUpstream:
    kind = "fleet"
    model_name: str | None = None  # the backends decide what a request naming no model gets

    def __init__(self, fleet: Fleet, config: GatewayConfig) -> None:
        self.fleet = fleet
        self.planner = Planner(config)
        self.routes: list[HTTPRouteHandler] = [backends]
        self._checks: asyncio.Task[None] | None = None
        self._engine: FleetEngine | None = None

    def _seam(self, model: str | None, pinned: str | None, extra_key: bytes = b"") -> FleetEngine | None:
        """The workers behind the engine seam, for a request naming `model`, pinned to a version or
        not, in the prefix-cache partition named by `extra_key` (None: relay it as sent)."""
        fleet, text = self.fleet, self.fleet.text_side
        if text is None or (model is not None and model != text.side.model):
            return None
        if not text.side.max_model_len:  # a worker older than the generate route sends none
            return None
        known = [b for b in fleet.backends if b.kind is not None]
        if not known or any(b.kind != "ctxfuse" or not b.serves(text.side.model) for b in known):
            return None
        if self._engine is None or self._engine.side is not text.side:
            self._engine = FleetEngine(fleet, text.side, text.tokenizer, text.template)
        return self._engine.for_request(pinned, extra_key)

    def stats(self) -> EngineStats | None:
        return None

    def dead_reason(self) -> str | None:
        return None  # the router lives on while its backends come and go: /ready says whether any is up

    def not_ready_reason(self) -> str | None:
        if not any(b.may_take_work() for b in self.fleet.backends):
            return "no backend takes requests"
        return (
            "no tokenizer yet: no ctxfuse worker has sent its text side" if self.fleet.keys is None else None
        )

    def check_model(self, name: str | None) -> None:
        pass  # each backend answers for its own models

    async def start(self) -> None:
        fleet = self.fleet
        await check_all(fleet)  # kinds, and the text side where a worker sends it, known before serving
        self._checks = asyncio.get_running_loop().create_task(run_checks(fleet), name="fleet-health")
        if fleet.sync is not None:
            fleet.sync.start()

    async def stop(self) -> None:
        if self._checks is not None:
            self._checks.cancel()
            await asyncio.gather(self._checks, return_exceptions=True)
        if self.fleet.sync is not None:
            await self.fleet.sync.stop()
        await self.fleet.close()
        await self.planner.close()

    # -- live requests -------------------------------------------------------------------------

    async def chat(
        self, request: AnyRequest, gw: Gateway, req: ChatCompletionRequest, raw: bytes, arrival: float
    ) -> ChatAnswer:
        salt = self.planner.cache_salt(principal_of(request.state).cache_salt)  # as the plan's will be
        extra = b"" if salt is None else salt_key(salt)
        pinned = request.headers.get(VERSION_HEADER)
        engine = None if _has_image_urls(req) else self._seam(req.model, pinned, extra)
        if engine is None:
            return ChatAnswer(relayed=await self._route(request, gw, "/v1/chat/completions", req, raw))
        answer = await self.planner.chat(request, gw, engine, req, arrival)
        answer.headers.update(_backend_header(engine))
        return answer

    async def completion(
        self, request: AnyRequest, gw: Gateway, req: CompletionRequest, raw: bytes, arrival: float
    ) -> Answered:
        engine = self._seam(req.model, request.headers.get(VERSION_HEADER))
        if engine is not None:
            return _tagged(await self.planner.completion(request, gw, engine, req, arrival), engine)
        return await self._route(request, gw, "/v1/completions", req, raw)

    async def _route(
        self,
        request: AnyRequest,
        gw: Gateway,
        path: str,
        req: ChatCompletionRequest | CompletionRequest,
        raw: bytes,
    ) -> Answered:
        fleet = self.fleet
        principal = principal_of(request.state)
        tpm = principal.key.limits.tpm if principal.key is not None else None
        salt = fleet.config.cache_salt(principal.cache_salt)  # the workers' partition
        extra = b"" if salt is None else salt_key(salt)  # the router's memo is partitioned the same way
        if fleet.tokenizes(tpm is not None):  # off the loop: a long prompt takes milliseconds
            keys, prompt = await asyncio.to_thread(fleet.request_keys, req, tpm is not None, extra)
        else:  # text-chunk keys: a few hashes, less than the hop to a thread costs
            keys, prompt = fleet.request_keys(req, False, extra)
        settle = None
        if tpm is not None:
            ticket = await reserve_tokens(
                request.state, gw.limiter, most_tokens(req, prompt, fleet.max_model_len(), tpm)
            )
            if ticket is not None:
                settle = Settle(gw.limiter, ticket)
                raw = with_usage(req, raw)  # the backend reports a stream's usage; the client's ask stands
        out = Outgoing(path, raw, keys, request.headers.get(VERSION_HEADER), salt, req.model)
        try:
            # a client gone before the answer: closing the backend request aborts the work there too
            answered = await cancel_on_disconnect(request.receive, forward(fleet, out))
        except BaseException:
            if settle is not None:
                settle.nothing_used()
            raise
        return answered if settle is None else settle.on(answered, asked_usage(req))

    async def embeddings(
        self, request: AnyRequest, gw: Gateway, req: EmbeddingRequest, raw: bytes, arrival: float
    ) -> Answered:
        engine = self._seam(req.model, request.headers.get(VERSION_HEADER))
        if engine is not None:
            return _tagged(await self.planner.embeddings(request, gw, engine, req), engine)
        principal = principal_of(request.state)
        tpm = principal.key.limits.tpm if principal.key is not None else None
        settle = None
        if tpm is not None:
            ticket = await reserve_tokens(request.state, gw.limiter, min(len(raw), tpm))
            settle = None if ticket is None else Settle(gw.limiter, ticket)
        out = Outgoing(
            EMBEDDINGS_PATH, raw, RequestKeys([], ""), request.headers.get(VERSION_HEADER), None, req.model
        )
        try:
            answered = await cancel_on_disconnect(request.receive, forward(self.fleet, out))
        except BaseException:
            if settle is not None:
                settle.nothing_used()
            raise
        return answered if settle is None else settle.on(answered, False)

    # -- models and tokens ---------------------------------------------------------------------

    async def _first_answer(self, path: str) -> httpx.Response | None:
        """The first reachable backend's 200 to GET `path`, else the first 4xx (every backend saying
        no), else None when none answers."""
        refusal: httpx.Response | None = None
        fleet = self.fleet
        for b in fleet.backends:
            if b.reachable and b.kind is not None:
                with contextlib.suppress(httpx.HTTPError):
                    resp = await fleet.client.get(f"{b.url}{path}", timeout=5)
                    if resp.status_code == 200:
                        return resp
                    if resp.status_code < 500 and refusal is None:
                        refusal = resp
        return refusal

    async def models(self, request: AnyRequest, gw: Gateway) -> Response[bytes]:
        resp = await self._first_answer("/v1/models")
        if resp is not None and resp.status_code == 200:
            return Response(resp.content, media_type=JSON)
        return Response(encode({"object": "list", "data": []}), media_type=JSON)

    async def model(self, request: AnyRequest, gw: Gateway, model_id: str) -> Response[bytes]:
        # the path as the client sent it, checked: never the decoded id, whose `../` the HTTP client
        # would resolve into another route of the backend (an /internal one, asked by us)
        resp = await self._first_answer(forwarded_path(request.scope["raw_path"]))
        if resp is None:
            raise ServiceUnavailableError("no backend is reachable")
        return Response(resp.content, status_code=resp.status_code, media_type=JSON)

    async def _by_load(self, request: AnyRequest, path: str, raw: bytes) -> Answered:
        """A request with no prompt to match (tokenizing): the least loaded backend of the request's
        version answers it, with the same failover as a completion."""
        out = Outgoing(path, raw, RequestKeys([], ""), request.headers.get(VERSION_HEADER))
        return await forward(self.fleet, out)

    async def tokenize(self, request: AnyRequest, gw: Gateway, raw: bytes) -> Answered:
        return await self._by_load(request, "/tokenize", raw)

    async def detokenize(self, request: AnyRequest, gw: Gateway, raw: bytes) -> Answered:
        return await self._by_load(request, "/detokenize", raw)

    # -- batch requests ------------------------------------------------------------------------

    async def execute(
        self, gw: Gateway, endpoint: str, raw: bytes, rid: str, priority: int, owner: str
    ) -> Answer:
        gw.check_taking_work()
        engine = None
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):  # relayed: answered there
            named = msgspec.json.decode(raw, type=_Named)
            salt = self.planner.cache_salt(Principal(owner).cache_salt)  # the owner's partition
            extra = b"" if salt is None else salt_key(salt)
            engine = None if named.has_image_urls() else self._seam(named.model, None, extra)  # no pin
        if engine is not None:
            return await self.planner.execute(gw, engine, _any_model, endpoint, raw, rid, priority, owner)
        return await execute_routed(self.fleet, endpoint, raw, owner)


class _Part(msgspec.Struct):
    type: str = ""


class _Message(msgspec.Struct):
    content: str | list[_Part] | None = None


class _Named(msgspec.Struct):
    """What a batch line's body says of where it may go."""

    model: str | None = None
    messages: list[_Message] = []

    def has_image_urls(self) -> bool:
        return any(
            isinstance(m.content, list) and any(p.type == "image_url" for p in m.content)
            for m in self.messages
        )


def _any_model(name: str | None) -> None:
    """The seam is chosen only for the workers' own model (FleetUpstream._seam)."""


def _has_image_urls(req: ChatCompletionRequest) -> bool:
    return any(
        isinstance(m.content, list) and any(p.type == "image_url" for p in m.content) for m in req.messages
    )


def _backend_header(engine: FleetEngine) -> dict[str, str]:
    """Which worker answered, for the client's logs and ours."""
    return {BACKEND_HEADER: ",".join(dict.fromkeys(engine.answered_by))} if engine.answered_by else {}


def _tagged(answered: Answered, engine: FleetEngine) -> Answered:
    for name, value in _backend_header(engine).items():
        answered.headers[name] = value
    return answered


def asked_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(req.stream_options is not None and req.stream_options.include_usage)


class BackendView(msgspec.Struct, kw_only=True):
    name: str
    url: str
    kind: str | None
    version: str
    circuit: str
    reachable: bool
    draining: bool
    in_flight: int
    load: float
    prefix_keys: int
    max_model_len: int | None


class FleetView(msgspec.Struct, kw_only=True):
    policy: str
    backends: list[BackendView]
    versions: dict[str, str]  # version -> stable | canary | rolled_back
    weights: dict[str, float]


@get("/fleet/v1/backends", summary="What the router knows of each backend")
async def backends(request: AnyRequest) -> Response[bytes]:
    gw: Gateway = request.app.state.gateway
    up = gw.upstream
    if not isinstance(up, FleetUpstream):
        raise ServiceUnavailableError("this gateway routes to no fleet")
    return Response(encode(fleet_view(up.fleet)), media_type=JSON)


def fleet_view(fleet: Fleet) -> FleetView:
    """What the router knows of each backend, its canary's versions and weights."""
    return FleetView(
        policy=fleet.config.policy,
        backends=[
            BackendView(
                name=b.name,
                url=b.url,
                kind=b.kind,
                version=b.spec.version,
                circuit=b.circuit.state,
                reachable=b.reachable,
                draining=b.draining,
                in_flight=b.in_flight,
                load=round(b.load(), 3),
                prefix_keys=fleet.index.held_by(b.name),
                max_model_len=b.max_model_len,
            )
            for b in fleet.backends
        ],
        versions={v: fleet.canary.state(v) for v in fleet.canary.versions},
        weights=fleet.canary.weights,
    )
