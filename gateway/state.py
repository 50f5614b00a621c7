"""The gateway's per-process state that routes share: the backend, the options, metrics, the draining
flag. One instance per app (held in Litestar's app state)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from shared.errors import NotFoundError

from .backend import Backend
from .chunk_store import ChunkStore
from .config import GatewayConfig
from .errors import ServiceUnavailableError
from .images import Images
from .logprobs import TokenTexts
from .metrics import Metrics

if TYPE_CHECKING:
    from .batch_runner import BatchRunner


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

    def not_ready_reason(self) -> str | None:
        if self.draining:
            return "draining: the server is shutting down"
        if not self.backend.is_alive():
            return "the engine has stopped"
        return None

    def backend_for_work(self) -> Backend:
        reason = self.not_ready_reason()
        if reason is not None:
            raise ServiceUnavailableError(f"not accepting requests: {reason}")
        return self.backend

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.backend.model_name:
            raise NotFoundError(
                f"the model `{name}` does not exist; this server serves `{self.backend.model_name}`",
                param="model",
                code="model_not_found",
            )
