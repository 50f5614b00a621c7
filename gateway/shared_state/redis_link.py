"""The gateway's link to Redis (`ctxfuse serve --redis-url`): the state several replicas share.

With a URL, the pieces that must agree across replicas keep their state in one Redis: per-key rate
limits (access/limits_redis.py), tenants' keys (access/keys_redis.py), the Batch API's files, batches,
Idempotency-Keys and leases, and the edge link's chunks. Without one, each stays in this process or
its local SQLite file, as on one machine.

Every piece fails closed when Redis cannot be reached: its routes answer 503 naming Redis
(`SharedStateDown`), never a hang (every call has a socket timeout) and never a silent fallback to
this replica's own state, which would let a fleet of N replicas admit N times a key's limit or miss
a revocation. A command that timed out is not sent again (redis-py's default would retry it three
times, so an outage would hold each call ~15 s, and a write that landed late would land twice); one
that met a broken connection (Redis restarted, a pooled socket closed) is sent once more on a new one.

Two clients over one URL: an asyncio one for the event loop's calls (limits), and a thread-safe
blocking one for stores that already run off the loop in threads (keys, batches, chunks).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable
from typing import Any

import redis
import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.retry import Retry

from gateway.errors import ServiceUnavailableError

log = structlog.get_logger("ctxfuse.gateway")

TIMEOUT_S = 2.0  # connect and per-command socket timeout: an unreachable Redis fails fast
NAMESPACE = "ctxfuse"


class SharedStateDown(ServiceUnavailableError):
    """Redis, which holds this state for every replica, cannot be reached (503)."""

    def __init__(self, what: str, exc: BaseException | None = None) -> None:
        reason = f": {type(exc).__name__}" if exc is not None else ""
        super().__init__(f"{what} is unavailable: the shared state (Redis) cannot be reached{reason}")


def replica_id() -> str:
    """This process among the replicas (host name and pid): owns leases and in-flight slots."""
    return f"{socket.gethostname()}:{os.getpid()}"


class RedisLink:
    def __init__(self, url: str, namespace: str = NAMESPACE, replica: str | None = None) -> None:
        self.url = url
        self.namespace = namespace
        self.replica = replica or replica_id()
        opts: dict[str, Any] = {"socket_timeout": TIMEOUT_S, "socket_connect_timeout": TIMEOUT_S}
        broken = (RedisConnectionError,)  # sent once more; a timeout is not (see above)
        # parse now: a malformed URL is an error at start, not at the first request
        self.sync: redis.Redis = redis.Redis.from_url(url, retry=Retry(NoBackoff(), 1, broken), **opts)
        self._opts = {**opts, "retry": AsyncRetry(NoBackoff(), 1, broken)}
        self._async: aioredis.Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def key(self, *parts: str) -> str:
        """A key in this gateway's namespace: `ctxfuse:limits:req:<key id>`."""
        return ":".join((self.namespace, *parts))

    @property
    def aio(self) -> aioredis.Redis:
        """The asyncio client of the running loop (made on first use there: a client is bound to one loop)."""
        loop = asyncio.get_running_loop()
        if self._async is None or self._loop is not loop:
            self._async = aioredis.Redis.from_url(self.url, **self._opts)
            self._loop = loop
        return self._async

    def check(self) -> str | None:
        """Why Redis cannot be used now, or None (a PING answered)."""
        try:
            self.sync.ping()
        except RedisError as exc:
            return f"Redis at {redacted(self.url)} cannot be reached: {exc}"
        return None

    async def aclose(self) -> None:
        """Close both clients (the gateway's shutdown, after everything that uses them)."""
        if self._async is not None:
            await self._async.aclose()
            self._async = None
        self.sync.close()

    def close(self) -> None:
        self.sync.close()


def redacted(url: str) -> str:
    """The URL without its password, for logs and errors."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.split('@', 1)[1]}"


DOWN = (RedisError, OSError)  # what a call to an unreachable or failing Redis raises


class Unawaited:
    """Calls to Redis that nothing waits for (a settlement, a note to the other replicas): each runs
    as a task held here until it ends; one that fails because Redis is down is logged as `lost`."""

    def __init__(self, lost: str) -> None:
        self.lost = lost  # the log event of a call that failed
        self.tasks: set[asyncio.Task[None]] = set()

    def send(self, call: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(self._quietly(call))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _quietly(self, call: Awaitable[Any]) -> None:
        try:
            await call
        except DOWN as exc:
            log.warning(self.lost, error=type(exc).__name__)
