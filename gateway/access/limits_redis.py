"""Per-key limits shared by every gateway replica (`--redis-url`): the same rules as access/limits.py
(requests and tokens over a sliding 60-second window, reservations settled to what was used, requests
in flight), kept in Redis so that a key's limit holds for the fleet, not per replica.

Each decision is one Lua script, so it is atomic across replicas: two replicas admitting the key's
last request at once cannot both win. The scripts read Redis's own clock (TIME), so the replicas'
clocks do not matter. Per key:
- `limits:req:<id>`   sorted set: admitted tickets, scored by admission time
- `limits:tok:<id>`   sorted set: reserving tickets, scored by reservation time
- `limits:tokv:<id>`  hash: ticket -> tokens reserved (then used, once settled)
- `limits:toksum:<id>` the sum of that hash, kept as it changes
- `limits:run:<id>`   sorted set: tickets in flight, scored by when the slot lapses
Every key expires when its window has passed, so a key that stops sending leaves nothing behind.

A request's in-flight slot is released when it ends; one held by a replica that died (kill -9)
lapses after IN_FLIGHT_TTL_S instead of being held forever. Settling and releasing are sent without
waiting (the response has already gone); if Redis is down then, the reservation stays at its
reserved size until the window passes and the slot lapses: the key is charged more, never less.
Unreachable Redis: admission and reservation raise SharedStateDown (503), never admit unlimited.
"""

from __future__ import annotations

import uuid
from typing import Any

from redis.commands.core import AsyncScript as Script

from gateway.access.keys import ApiKey
from gateway.access.limits import WINDOW_S, Limited, Ticket, concurrency_refusal, rate_headers
from gateway.shared_state.redis_link import DOWN, RedisLink, SharedStateDown, Unawaited

IN_FLIGHT_TTL_S = 900.0  # a dead replica's in-flight slots lapse after this (longer than any request)

# Every script takes KEYS = req, run, tok, tokv, toksum of one key, and ARGV[1] = the window.
# `usage()` expires what left the window (each entry once: the running token sum is kept, never
# recounted, so a decision costs O(log n) however busy the key) and returns {requests, seconds until
# the oldest request leaves, tokens, seconds until the oldest reservation leaves}: what the
# x-ratelimit-* headers say, so an answer's headers cost no further round trip.
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local window = tonumber(ARGV[1])
local keep_ms = math.ceil(window * 1000) + 1000
local function usage()
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now - window)
  if #gone > 0 then
    local freed = 0
    for _, v in ipairs(redis.call('HMGET', KEYS[4], unpack(gone))) do freed = freed + (tonumber(v) or 0) end
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - window)
    redis.call('HDEL', KEYS[4], unpack(gone))
    redis.call('DECRBY', KEYS[5], freed)
  end
  local r = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  local k = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  return {redis.call('ZCARD', KEYS[1]), r[2] and tostring(tonumber(r[2]) + window - now) or '0',
          tonumber(redis.call('GET', KEYS[5]) or '0'),
          k[2] and tostring(tonumber(k[2]) + window - now) or '0'}
end
"""

# ARGV: window, rpm (-1: none), max_concurrent (-1: none), ticket, in-flight ttl
# -> {0, usage...} admitted | {1} concurrency | {2, seconds until a request leaves the window}
_ADMIT = (
    _PRELUDE
    + """
local rpm, conc, ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[5])
local u = usage()
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if conc >= 0 and redis.call('ZCARD', KEYS[2]) >= conc then return {1} end
if rpm >= 0 and u[1] >= rpm then return {2, u[2]} end
redis.call('ZADD', KEYS[1], now, ARGV[4])
redis.call('ZADD', KEYS[2], now + ttl, ARGV[4])
redis.call('PEXPIRE', KEYS[1], keep_ms)
redis.call('PEXPIRE', KEYS[2], math.ceil(ttl * 1000))
return {0, u[1] + 1, u[1] == 0 and tostring(window) or u[2], u[3], u[4]}
"""
)

# ARGV: window, tpm, tokens, ticket -> {0, usage...} reserved | {1, seconds until it fits, tokens}
_RESERVE = (
    _PRELUDE
    + """
local tpm, tokens = tonumber(ARGV[2]), tonumber(ARGV[3])
local u = usage()
local sum = u[3]
if sum + tokens > tpm then
  local room, wait = tpm - tokens, 0
  local entries = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    if sum <= room then break end
    sum = sum - tonumber(redis.call('HGET', KEYS[4], entries[i]) or '0')
    wait = tonumber(entries[i + 1]) + window - now
  end
  return {1, tostring(math.max(wait, 0)), u[3]}
end
redis.call('ZADD', KEYS[3], now, ARGV[4])
redis.call('HSET', KEYS[4], ARGV[4], tokens)
redis.call('INCRBY', KEYS[5], tokens)
for i = 3, 5 do redis.call('PEXPIRE', KEYS[i], keep_ms) end
return {0, u[1], u[2], u[3] + tokens, u[4] == '0' and tostring(window) or u[4]}
"""
)

# ARGV: window, ticket, used (-1: nothing to settle), release (1: free the in-flight slot too): the
# reservation becomes what was used, if it is still in the window; one call for a request's end
_SETTLE = """
local old = redis.call('HGET', KEYS[4], ARGV[2])
if tonumber(ARGV[3]) >= 0 and old and redis.call('ZSCORE', KEYS[3], ARGV[2]) then
  redis.call('HSET', KEYS[4], ARGV[2], ARGV[3])
  redis.call('INCRBY', KEYS[5], tonumber(ARGV[3]) - tonumber(old))
end
if ARGV[4] == '1' then redis.call('ZREM', KEYS[2], ARGV[2]) end
return 0
"""

_USAGE = (
    _PRELUDE
    + """
return usage()
"""
)


class RedisLimiter:
    """access/limits.py's Limiter, over Redis: one window per key for all replicas."""

    def __init__(self, link: RedisLink) -> None:
        self._link = link
        self._unawaited = Unawaited("limits_update_lost")  # settles and releases on their way
        self._pending = self._unawaited.tasks
        # sent once, then called by their hash (EVALSHA) on the running loop's client
        # (the client given here only encodes the script's hash)
        encoder: Any = link.sync
        self._admit, self._reserve, self._settle, self._usage = (
            Script(encoder, text) for text in (_ADMIT, _RESERVE, _SETTLE, _USAGE)
        )

    def _keys(self, key_id: str) -> list[str]:
        return [self._link.key("limits", kind, key_id) for kind in ("req", "run", "tok", "tokv", "toksum")]

    async def _run(self, script: Script, key_id: str, *args: str | int | float) -> Any:
        return await script(self._keys(key_id), [WINDOW_S, *args], client=self._link.aio)

    async def _decide(self, script: Script, key_id: str, *args: str | int | float) -> Any:
        try:
            return await self._run(script, key_id, *args)
        except DOWN as exc:
            raise SharedStateDown("rate limiting", exc) from exc

    async def admit(self, key: ApiKey) -> Ticket | Limited:
        lim = key.limits
        ticket = Ticket(key.id, token=uuid.uuid4().hex)
        rpm = -1 if lim.rpm is None else lim.rpm
        conc = -1 if lim.max_concurrent is None else lim.max_concurrent
        out = await self._decide(self._admit, key.id, rpm, conc, ticket.token, IN_FLIGHT_TTL_S)
        if int(out[0]) == 1:
            return concurrency_refusal(lim.max_concurrent or 0)
        if int(out[0]) == 2:
            wait = float(out[1])
            return Limited("requests", f"rate limit of {lim.rpm} requests per minute reached", wait)
        ticket.window = _window(out[1:])
        return ticket

    async def reserve(self, key: ApiKey, ticket: Ticket, tokens: int) -> Limited | None:
        tpm = key.limits.tpm
        if tpm is None:
            return None
        if tokens > tpm:
            return Limited.too_many_tokens(tokens, tpm)
        out = await self._decide(self._reserve, key.id, tpm, tokens, ticket.token)
        if int(out[0]) == 1:
            return Limited(
                "tokens",
                f"rate limit of {tpm} tokens per minute reached ({int(out[2])} used or reserved, "
                f"this request may use {tokens})",
                float(out[1]),
            )
        ticket.reserved = True
        ticket.window = _window(out[1:])
        return None

    def settle(self, ticket: Ticket, used: int) -> None:
        """Sent with the release when the request is still running (one round trip for its end),
        else at once."""
        if not ticket.reserved:
            return
        ticket.reserved = False
        if ticket.released:
            self._unawaited.send(self._run(self._settle, ticket.key_id, ticket.token, used, 0))
        else:
            ticket.used = used

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        used = -1 if ticket.used is None else ticket.used
        self._unawaited.send(self._run(self._settle, ticket.key_id, ticket.token, used, 1))

    async def headers(self, key: ApiKey, ticket: Ticket | None = None) -> list[tuple[bytes, bytes]]:
        """From the window the ticket's admission or reservation saw (no round trip), else read now."""
        lim = key.limits
        if lim.rpm is None and lim.tpm is None:
            return []
        window = None if ticket is None else ticket.window
        if window is None:
            try:
                window = _window(await self._run(self._usage, key.id))
            except DOWN:
                return []  # the answer goes on without them
        return rate_headers(lim, *window)


def _window(out: list[Any]) -> tuple[int, float, int, float]:
    return int(out[0]), float(out[1]), int(out[2]), float(out[3])
