"""The engine as the gateway's upstream (`ctxfuse serve`, `ctxfuse worker`): the engine behind
`Backend` (gateway/seam.py), in this process or in a child process (cloud/serving/), answered through
the one planner every backend shares (openai/planner.py). A worker also serves the internal routes its
router reads (backends/worker.py).
"""

from __future__ import annotations

from litestar import Response
from litestar.handlers import HTTPRouteHandler

from gateway.backends.worker import ROUTES as WORKER_ROUTES
from gateway.backends.worker import WorkerEngine
from gateway.batch.executor import Answer
from gateway.config import GatewayConfig
from gateway.edge.stores import AnyChunkStore
from gateway.openai.planner import Planner, json_response
from gateway.ops import tracing
from gateway.seam import Backend
from gateway.state import Gateway
from gateway.upstream import Answered, AnyRequest, ChatAnswer
from shared.embeddings_protocol import EmbeddingRequest
from shared.engine_types import EngineStats
from shared.errors import NotFoundError
from shared.protocol import ChatCompletionRequest, CompletionRequest
from shared.service_protocol import Model, ModelList

# the open requests' errors say why it stopped (the exit code, the exception); the log has the rest
ENGINE_DEAD = "the engine has stopped; the server must be restarted"


class EngineUpstream:
    kind = "engine"

    def __init__(self, backend: Backend, config: GatewayConfig, worker: WorkerEngine | None = None) -> None:
        self.backend = tracing.traced(backend)  # itself unless traces are on
        self.model_name: str | None = backend.model_name
        self.names = {backend.model_name}  # and its aliases, when several models are served (models.py)
        self.planner = Planner(config)
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
        await self.planner.close()

    # -- requests --------------------------------------------------------------------------------

    async def chat(
        self, request: AnyRequest, gw: Gateway, req: ChatCompletionRequest, raw: bytes, arrival: float
    ) -> ChatAnswer:
        return await self.planner.chat(request, gw, self.backend, req, arrival)

    async def completion(
        self, request: AnyRequest, gw: Gateway, req: CompletionRequest, raw: bytes, arrival: float
    ) -> Answered:
        return await self.planner.completion(request, gw, self.backend, req, arrival)

    async def embeddings(
        self, request: AnyRequest, gw: Gateway, req: EmbeddingRequest, raw: bytes, arrival: float
    ) -> Answered:
        return await self.planner.embeddings(request, gw, self.backend, req)

    def _model(self, gw: Gateway) -> Model:
        b = self.backend
        return Model(id=b.model_name, created=gw.created, max_model_len=b.max_model_len)

    async def models(self, request: AnyRequest, gw: Gateway) -> Response[bytes]:
        return json_response(ModelList(data=[self._model(gw)]))

    async def model(self, request: AnyRequest, gw: Gateway, model_id: str) -> Response[bytes]:
        self.check_model(model_id)
        return json_response(self._model(gw))

    async def tokenize(self, request: AnyRequest, gw: Gateway, raw: bytes) -> Answered:
        return await self.planner.tokenize(self.backend, self.check_model, raw)

    async def detokenize(self, request: AnyRequest, gw: Gateway, raw: bytes) -> Answered:
        return await self.planner.detokenize(self.backend, self.check_model, raw)

    async def execute(
        self, gw: Gateway, endpoint: str, raw: bytes, rid: str, priority: int, owner: str
    ) -> Answer:
        return await self.planner.execute(
            gw, self.backend, self.check_model, endpoint, raw, rid, priority, owner
        )


def engine_gateway(
    backend: Backend,
    config: GatewayConfig,
    chunk_store: AnyChunkStore | None = None,
    worker: WorkerEngine | None = None,
) -> Gateway:
    """The gateway's state over an engine (`chunk_store`: the edge link's, when it listens)."""
    return Gateway(EngineUpstream(backend, config, worker), config, chunk_store)
