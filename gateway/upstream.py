"""What the gateway's one app hands work to: an `Upstream`.

The app (gateway/app.py) owns everything a request meets before and after its answer is made, once
for every kind of backend: authentication, per-key limits and allowed models, strict decoding of the
body, ownership of files and batches, the error shape, draining, request logs and metrics. An
upstream only answers what got through:

- `EngineUpstream` (backends/local.py): the model's engine, in this process or a child process
  (`ctxfuse serve`, and `ctxfuse worker` with the internal routes a router reads);
- `FleetUpstream` (backends/fleet/upstream.py): the router, which sends each request to the worker
  that holds its prompt's prefix (`ctxfuse serve --fleet` / `--backend URL`).

Both answer through the one planner (openai/planner.py) over an engine behind the seam (seam.py):
their own, or the fleet's workers; only requests to servers that are not ours are relayed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from litestar import Request, Response
from litestar.handlers import HTTPRouteHandler
from litestar.response import Stream

from shared.embeddings_protocol import EmbeddingRequest
from shared.engine_types import EngineStats
from shared.protocol import ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from gateway.batch.executor import Answer
    from gateway.state import Gateway

AnyRequest = Request[Any, Any, Any]
Answered = Response[Any] | Stream

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


def _nothing() -> None:
    pass


@dataclass(slots=True)
class ChatAnswer:
    """A chat completion as an upstream answers it: typed (whole, or a stream of chunks that raises
    when it fails after its start), or relayed as a server that is not ours sent it. The chat route
    encodes it (routes.py); the Responses API reads the same chunks (responses.py)."""

    whole: ChatCompletion | None = None
    chunks: AsyncIterator[ChatCompletionChunk] | None = None
    close: Callable[[], None] = _nothing  # aborts the stream's work (its body may never start)
    relayed: Answered | None = None
    headers: dict[str, str] = field(default_factory=dict)


class Upstream(Protocol):
    kind: str  # "engine" | "fleet": for the start-up line and /health
    # the model a request that names none gets (None: the fleet's backends decide)
    model_name: str | None
    # its own routes beyond the OpenAI ones (a worker's /internal routes, the fleet's view)
    routes: list[HTTPRouteHandler]

    def stats(self) -> EngineStats | None:
        """The engine's figures for /metrics (None: no engine in this process)."""

    def dead_reason(self) -> str | None:
        """Why this process can never answer again (a dead engine: /health 503, `serve` exits)."""

    def not_ready_reason(self) -> str | None:
        """Why no request can be taken now (/ready 503), draining aside."""

    def check_model(self, name: str | None) -> None:
        """404 for a model this upstream does not serve (the fleet leaves it to its backends)."""

    async def chat(
        self, request: AnyRequest, gw: Gateway, req: ChatCompletionRequest, raw: bytes, arrival: float
    ) -> ChatAnswer:
        """A chat completion for the decoded `req` (`raw`: its body as the client sent it)."""

    async def completion(
        self, request: AnyRequest, gw: Gateway, req: CompletionRequest, raw: bytes, arrival: float
    ) -> Answered:
        """A legacy completion for the decoded `req` (`raw`: its body as the client sent it)."""

    async def embeddings(
        self, request: AnyRequest, gw: Gateway, req: EmbeddingRequest, raw: bytes, arrival: float
    ) -> Answered:
        """Embeddings for the decoded `req` (`raw`: its body as the client sent it)."""

    async def models(self, request: AnyRequest, gw: Gateway) -> Response[bytes]: ...

    async def model(self, request: AnyRequest, gw: Gateway, model_id: str) -> Response[bytes]:
        """`model_id`: as the path names it, undecoded (`forwarded_path` has checked it)."""

    async def tokenize(self, request: AnyRequest, gw: Gateway, raw: bytes) -> Answered: ...

    async def detokenize(self, request: AnyRequest, gw: Gateway, raw: bytes) -> Answered: ...

    async def execute(
        self, gw: Gateway, endpoint: str, raw: bytes, rid: str, priority: int, owner: str
    ) -> Answer:
        """One batch request, answered as its route would answer it, run as the batch's owner;
        raises QueueFullError or ServiceUnavailableError when it cannot be taken now (the runner
        tries again later)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
