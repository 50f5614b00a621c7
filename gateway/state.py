"""The gateway's per-process state that routes share, whatever answers them: the upstream (an engine
or the fleet), the options, metrics, per-key limits, the batch runner, the edge link's chunk store
and the draining flag. One instance per process, shared by the OpenAI port's app and the edge
listener's (held in Litestar's app state)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gateway.access.limits import Limiter, RateLimiter
from gateway.access.limits_redis import RedisLimiter
from gateway.config import GatewayConfig
from gateway.edge.stores import AnyChunkStore
from gateway.errors import ServiceUnavailableError
from gateway.ops.metrics import Metrics
from gateway.shared_state.redis_link import RedisLink
from gateway.upstream import Upstream
from shared.errors import EngineDeadError

if TYPE_CHECKING:
    from gateway.access.keys import Keys
    from gateway.batch.runner import BatchRunner
    from gateway.console.usage import SharedUsage

DRAINING = "draining: the server is shutting down"


class Gateway:
    def __init__(
        self,
        upstream: Upstream,
        config: GatewayConfig,
        chunk_store: AnyChunkStore | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.upstream = upstream
        self.config = config
        self.chunk_store = chunk_store  # the edge link's chunks (when the edge listener runs)
        self.metrics = metrics or Metrics(upstream.stats)
        self.created = int(time.time())
        self.draining = False  # set on SIGTERM: finish what runs, take nothing new
        # the Batch API's runner, one per process: made by the first app built over this state
        self.batches: BatchRunner | None = None
        # the state replicas share (`--redis-url`), else None: this process's own
        self.redis: RedisLink | None = None if config.redis_url is None else RedisLink(config.redis_url)
        # per-key requests, tokens and in-flight counts (access/auth.py)
        self.limiter: Limiter = RateLimiter() if self.redis is None else RedisLimiter(self.redis)
        # tenants' keys, as the OpenAI port's app checks them (none on a worker)
        self.keys: Keys | None = None
        # tenants' usage added up across replicas for the console (with --redis-url; console/usage.py)
        self.usage: SharedUsage | None = None
        self.lifecycle_owned = False  # an app's lifespan starts and stops the upstream and the runner

    def not_ready_reason(self) -> str | None:
        dead = self.upstream.dead_reason()
        if dead is not None:
            return dead
        if self.draining:
            return DRAINING
        return self.upstream.not_ready_reason()

    def check_taking_work(self) -> None:
        """Raise why no new work is taken: refused at once, never queued."""
        dead = self.upstream.dead_reason()
        if dead is not None:
            raise EngineDeadError(f"not accepting requests: {dead}")
        if self.draining:
            raise ServiceUnavailableError(f"not accepting requests: {DRAINING}")
