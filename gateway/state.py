"""The gateway's per-process state that routes share: the backend, the options, metrics, the draining
flag. One instance per app (held in Litestar's app state)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gateway.access.limits import RateLimiter
from gateway.backends.engine import Backend
from gateway.config import GatewayConfig
from gateway.edge.chunk_store import ChunkStore
from gateway.errors import ServiceUnavailableError
from gateway.openai.images import Images
from gateway.openai.logprobs import TokenTexts
from gateway.ops.metrics import Metrics
from shared.errors import EngineDeadError, NotFoundError

if TYPE_CHECKING:
    from gateway.batch.runner import BatchRunner


# the open requests' errors say why it stopped (the exit code, the exception); the log has the rest
ENGINE_DEAD = "the engine has stopped; the server must be restarted"


class Gateway:
    def __init__(
        self, backend: Backend, config: GatewayConfig, chunk_store: ChunkStore | None = None
    ) -> None:
        self.backend = backend
        self.chunk_store = chunk_store  # the edge link's chunks (when the edge listener runs)
        self.config = config
        self.metrics = Metrics(backend.stats)
        self.texts = TokenTexts(backend.tokenizer)
        self.created = int(time.time())
        self.draining = False  # set on SIGTERM: finish what runs, take nothing new
        # the Batch API's runner, one per process: made by the first app built over this state
        self.batches: BatchRunner | None = None
        self.images = Images(config.vision)  # image parts -> features, built on the first image
        self.limiter = RateLimiter()  # per-key requests, tokens and in-flight counts (access/auth.py)

    def not_ready_reason(self) -> str | None:
        if not self.backend.is_alive():
            return ENGINE_DEAD
        if self.draining:
            return "draining: the server is shutting down"
        return None

    def backend_for_work(self) -> Backend:
        """The backend, or the reason no new work is taken: refused at once, never queued."""
        if not self.backend.is_alive():
            raise EngineDeadError(f"not accepting requests: {ENGINE_DEAD}")
        if self.draining:
            raise ServiceUnavailableError("not accepting requests: draining: the server is shutting down")
        return self.backend

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.backend.model_name:
            raise NotFoundError(
                f"the model `{name}` does not exist; this server serves `{self.backend.model_name}`",
                param="model",
                code="model_not_found",
            )
