"""The edge link's chunk store in Redis (`--redis-url`): what gateway/edge/chunk_store.py keeps in one
SQLite file, shared by every gateway replica, so a document a device sent through one replica goes by
reference through any other.

The same semantics as ChunkStore, call for call: content-addressed and verified, bounded in bytes with
least-recently-used eviction, each chunk held per tenant (bytes stored once, a tenant holds a chunk
only once one of its own devices sent the bytes), lookups counted (per replica, for its metrics).
Every call that reads and writes is one Lua script, atomic across replicas as ChunkStore's
transaction is within one process: two replicas putting at once cannot both see room and overrun the
bound, and eviction cannot remove a chunk between a request's put and its get.

Keys (one hash tag, `{chunks}`, so that they share a slot on a Redis Cluster as the scripts need):
- `chunks:data`    hash: digest -> the chunk's bytes (HSTRLEN is its size, read without the bytes)
- `chunks:lru`     sorted set: digest -> last-use tick; the lowest is the least recently used
- `chunks:tick`    counter (INCR): the ticks, one clock for every replica, so the order is exact
- `chunks:bytes`   counter: the sum of the sizes in `chunks:data` (each chunk once)
- `chunks:owners`  sorted set, every score 0: member `digest + tenant` (the digest is DIGEST_BYTES
                   long, the tenant UTF-8, which never holds byte 0xFF), so `ZREMRANGEBYLEX
                   [d [d\\xff` drops every owner of d at once and ZSCORE tells whether one tenant does

Invariants (kept by the scripts): the digests of `data`, of `lru` and of the `owners` members are the
same set; `bytes` is the sum of `data`'s sizes; every stored value hashes to its digest (checked here
before the script runs). Eviction runs at the end of every put, down to that replica's budget, and
never removes the chunks the put stores or touches (as ChunkStore). Unlike ChunkStore, nothing is
evicted on open (this replica may open while Redis is down): a smaller budget applies from its first put.

The bound counts chunk bytes, not Redis's overhead per entry; the Redis must not evict keys itself
(maxmemory-policy noeviction, the default), or the counters drift from the hash.

Redis unreachable: every call raises SharedStateDown (503), before the request does anything. The
agent relays it to the app, which sends the request again; nothing was half done, and no replica
falls back to a store of its own (its devices would re-upload everything, and the chunks would not
be the other replicas'). `close` leaves the link
open: it belongs to the gateway, which shares it with the other stores.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

from gateway.shared_state.redis_link import DOWN, RedisLink, SharedStateDown
from shared.chunking import digest as chunk_digest
from shared.compression import ChunkError

WHAT = "the edge link's chunk store"
_T = TypeVar("_T")

# KEYS: data, owners; ARGV: tenant, digests... -> each digest's size, or -1 where the tenant holds none
_SIZES = """
local out = {}
for i = 2, #ARGV do
  local d = ARGV[i]
  if redis.call('ZSCORE', KEYS[2], d .. ARGV[1]) then
    out[i - 1] = redis.call('HSTRLEN', KEYS[1], d)
  else
    out[i - 1] = -1
  end
end
return out
"""

# KEYS: data, lru, owners, tick; ARGV: tenant, digests... -> each digest's bytes, or false where the
# tenant holds none; the found ones are touched in request order
_GET = """
local out = {}
for i = 2, #ARGV do
  local d = ARGV[i]
  out[i - 1] = false
  if redis.call('ZSCORE', KEYS[3], d .. ARGV[1]) then
    out[i - 1] = redis.call('HGET', KEYS[1], d)
    redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), d)
  end
end
return out
"""

# KEYS: data, lru, owners, tick, bytes; ARGV: tenant, max bytes, n, n (digest, bytes) pairs, then the
# digests to touch -> bytes evicted. Stores the new, makes every item the tenant's, touches the items
# and the tenant's touched chunks in order, then evicts the least recently used of the rest down to
# the budget.
_PUT = r"""
local tenant, max_bytes, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local keep = {}
local function touch(d)
  redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), d)
end
for i = 0, n - 1 do
  local d, v = ARGV[4 + 2 * i], ARGV[5 + 2 * i]
  if redis.call('HSETNX', KEYS[1], d, v) == 1 then
    redis.call('INCRBY', KEYS[5], #v)
  end
  redis.call('ZADD', KEYS[3], 0, d .. tenant)
  touch(d)
  keep[d] = true
end
for i = 4 + 2 * n, #ARGV do
  local d = ARGV[i]
  if redis.call('ZSCORE', KEYS[3], d .. tenant) then
    touch(d)
  end
  keep[d] = true
end
local excess = tonumber(redis.call('GET', KEYS[5]) or '0') - max_bytes
local freed, kept = 0, 0
while freed < excess do
  -- the oldest first; those kept stay in front, so the next batch starts after them
  local batch = redis.call('ZRANGE', KEYS[2], kept, kept + 99)
  if #batch == 0 then break end
  for _, d in ipairs(batch) do
    if freed >= excess then break end
    if keep[d] then
      kept = kept + 1
    else
      freed = freed + redis.call('HSTRLEN', KEYS[1], d)
      redis.call('HDEL', KEYS[1], d)
      redis.call('ZREM', KEYS[2], d)
      redis.call('ZREMRANGEBYLEX', KEYS[3], '[' .. d, '[' .. d .. '\255')
    end
  end
end
if freed > 0 then
  redis.call('DECRBY', KEYS[5], freed)
end
return freed
"""


@dataclass(frozen=True, slots=True)
class ChunkKeys:
    """The store's Redis keys (module docstring), in the link's namespace."""

    data: str
    lru: str
    owners: str
    tick: str
    bytes: str

    @classmethod
    def of(cls, link: RedisLink) -> ChunkKeys:
        return cls(*(link.key("{chunks}", name) for name in ("data", "lru", "owners", "tick", "bytes")))


class RedisChunkStore:
    def __init__(self, link: RedisLink, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self._max_bytes = max_bytes
        self._redis = link.sync
        self.keys = ChunkKeys.of(link)
        k = self.keys
        self._data, self._lru, self._owners, self._tick, self._bytes = (
            k.data,
            k.lru,
            k.owners,
            k.tick,
            k.bytes,
        )
        self._sizes = self._redis.register_script(_SIZES)  # sent by EVALSHA, loaded on first use
        self._get = self._redis.register_script(_GET)
        self._put = self._redis.register_script(_PUT)
        self._lock = threading.Lock()  # the counters below; Redis calls need none (the pool is thread-safe)
        self.hits = 0  # chunks found by missing() and get_many() of this replica
        self.misses = 0  # chunks not found by them
        self.bytes_read = 0  # chunk bytes get_many() has returned: what expanding requests materialized

    # -- reads ----------------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return int(self._call(lambda: self._redis.get(self._bytes)) or 0)

    @property
    def count(self) -> int:
        return int(self._call(lambda: self._redis.hlen(self._data)))

    def missing(self, digests: Sequence[bytes], *, tenant: str) -> list[bytes]:
        """The digests `tenant` does not hold, in request order, each once. Does not touch the LRU
        order."""
        wanted = _unique(digests)
        if not wanted:
            return []
        members = [_member(d, tenant) for d in wanted]
        # redis-py's stub says list[str]; any bytes are a member
        scores = self._call(lambda: self._redis.zmscore(self._owners, members))  # type: ignore[arg-type]
        absent = [d for d, score in zip(wanted, scores, strict=True) if score is None]
        self._count_lookups(len(wanted) - len(absent), len(wanted))
        return absent

    def sizes(self, digests: Sequence[bytes], *, tenant: str) -> dict[bytes, int]:
        """The byte size of each chunk `tenant` holds among `digests` (others are left out), read
        without its bytes. Neither touches the LRU order nor counts as a lookup."""
        wanted = _unique(digests)
        if not wanted:
            return {}
        out = self._call(lambda: self._sizes(keys=[self._data, self._owners], args=[tenant, *wanted]))
        return {d: int(size) for d, size in zip(wanted, out, strict=True) if int(size) >= 0}

    def get_many(self, digests: Sequence[bytes], *, tenant: str) -> dict[bytes, bytes]:
        """The chunks `tenant` holds among `digests` (others are left out), made most recently used,
        in request order."""
        wanted = _unique(digests)
        if not wanted:
            return {}
        keys = [self._data, self._lru, self._owners, self._tick]
        out = self._call(lambda: self._get(keys=keys, args=[tenant, *wanted]))
        found = {d: data for d, data in zip(wanted, out, strict=True) if data is not None}
        self._count_lookups(len(found), len(wanted))
        with self._lock:
            self.bytes_read += sum(len(data) for data in found.values())
        return found

    # -- writes ---------------------------------------------------------------------------------

    def put(self, digest: bytes, data: bytes, *, tenant: str) -> None:
        self.put_many({digest: data}, tenant=tenant)

    def put_many(self, items: Mapping[bytes, bytes], *, tenant: str, touch: Sequence[bytes] = ()) -> None:
        """Store `items` (digest -> bytes) for `tenant` in one atomic step, then evict down to the
        budget; `touch` as ChunkStore.put_many. Raises ChunkError, storing nothing, if any bytes do
        not match their digest."""
        for d, data in items.items():
            if chunk_digest(data) != d:
                raise ChunkError(f"chunk {d.hex()} does not match the digest of its {len(data)} bytes")
        pairs = [x for d, data in items.items() for x in (d, data)]
        args: list[bytes | str | int] = [tenant, self._max_bytes, len(items), *pairs, *_unique(touch)]
        keys = [self._data, self._lru, self._owners, self._tick, self._bytes]
        self._call(lambda: self._put(keys=keys, args=args))

    def close(self) -> None:
        """Nothing to release: the link is the gateway's."""

    def __enter__(self) -> RedisChunkStore:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _call(self, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except DOWN as exc:
            raise SharedStateDown(WHAT, exc) from exc

    def _count_lookups(self, found: int, looked_up: int) -> None:
        with self._lock:
            self.hits += found
            self.misses += looked_up - found


def _member(digest: bytes, tenant: str) -> bytes:
    """The `chunks:owners` member saying that `tenant` holds `digest`."""
    return digest + tenant.encode()


def _unique(digests: Iterable[bytes]) -> list[bytes]:
    return list(dict.fromkeys(digests))
