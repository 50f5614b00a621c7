"""The edge link's chunk store, whichever backs it: the one interface the edge routes use, and the one
place that picks the store for a gateway.

On one machine the chunks live in a local SQLite file (chunk_store.py); with `--redis-url` they live
in the Redis every replica shares (chunk_store_redis.py), so a device's document uploaded through one
replica goes by reference through any other. Both bound the same budget (`--chunk-store-mib`) and
answer per tenant the same way; tests/gateway/test_chunk_store.py runs the same behaviours on both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Protocol

from gateway.config import GatewayConfig
from gateway.edge.chunk_store import ChunkStore
from gateway.edge.chunk_store_redis import RedisChunkStore
from gateway.shared_state.redis_link import RedisLink


class AnyChunkStore(Protocol):
    """What ChunkStore documents, call for call; `hits`, `misses` and `bytes_read` count this process's
    lookups."""

    hits: int
    misses: int
    bytes_read: int

    @property
    def total_bytes(self) -> int: ...

    @property
    def count(self) -> int: ...

    def missing(self, digests: Sequence[bytes], *, tenant: str) -> list[bytes]: ...

    def sizes(self, digests: Sequence[bytes], *, tenant: str) -> dict[bytes, int]: ...

    def get_many(self, digests: Sequence[bytes], *, tenant: str) -> dict[bytes, bytes]: ...

    def put(self, digest: bytes, data: bytes, *, tenant: str) -> None: ...

    def put_many(self, items: Mapping[bytes, bytes], *, tenant: str, touch: Sequence[bytes] = ()) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> AnyChunkStore: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


def open_chunk_store(config: GatewayConfig, redis: RedisLink | None) -> AnyChunkStore:
    """The gateway's chunk store: in the shared Redis when it has one (Gateway.redis), else in the
    SQLite file `--chunk-store` (default under CTXFUSE_HOME). Opening the Redis one sends nothing, so a
    gateway starts while Redis is down and answers the edge routes 503 until it is back."""
    max_bytes = int(config.chunk_store_mib * 2**20)
    if redis is not None:
        return RedisChunkStore(redis, max_bytes)
    from cloud.model.registry import cache_dir  # the default file's home; only this path needs it

    return ChunkStore(config.chunk_store or cache_dir() / "chunks.sqlite", max_bytes)
