"""Tenants' API keys in Redis (`--redis-url`): the keys every gateway replica reads, written by
`ctxfuse keys ... --redis-url` as access/keys.py's SQLite store is by `ctxfuse keys`. Same rules:
only the SHA-256 of a key is kept, a lookup is by hash and the stored hash is compared again in
constant time, a revoked or expired key is never usable.

Layout (in the gateway's namespace):
- `keys:rec:<id>`     the record (JSON: ApiKey and its hash)
- `keys:hash:<hex>`   id of the key with that hash
- `keys:ids`          sorted set of ids by creation time (lists, `has_keys`)
A revocation is one write; replicas cache a lookup for at most access/auth.py's LOOKUP_TTL_S, so every
replica refuses a revoked key within seconds. Creation writes the record before the hash that finds it
(one MULTI), so a lookup never finds a half-made key. Unreachable Redis: SharedStateDown (503).
"""

from __future__ import annotations

import hmac
import time
from dataclasses import replace
from typing import Any

import msgspec

from gateway.access.keys import KEY_PREFIX, ApiKey, KeyLimits, key_hash, new_key, rotate
from gateway.shared_state.redis_link import DOWN, RedisLink, SharedStateDown
from shared.errors import NotFoundError


class _Stored(msgspec.Struct):
    key: ApiKey
    hash: bytes


class RedisKeyStore:
    """access/keys.py's KeyStore, in Redis. Thread-safe (the blocking client's pool)."""

    def __init__(self, link: RedisLink) -> None:
        self._link = link
        self._r = link.sync

    def _k(self, *parts: str) -> str:
        return self._link.key("keys", *parts)

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except DOWN as exc:
            raise SharedStateDown("API key lookup", exc) from exc

    def close(self) -> None:
        pass  # the link is the gateway's (or the CLI's) to close

    def create(
        self,
        tenant: str,
        limits: KeyLimits | None = None,
        *,
        name: str = "",
        expires_at: float | None = None,
        now: float | None = None,
    ) -> tuple[ApiKey, str]:
        record, key = new_key(tenant, limits, name=name, expires_at=expires_at, now=now)
        key_id, created = record.id, record.created_at
        digest = key_hash(key)

        def write() -> None:
            pipe = self._r.pipeline(transaction=True)
            pipe.set(self._k("rec", key_id), msgspec.json.encode(_Stored(record, digest)))
            pipe.set(self._k("hash", digest.hex()), key_id)
            pipe.zadd(self._k("ids"), {key_id: created})
            pipe.execute()

        self._call(write)
        return record, key

    def _stored(self, key_id: str) -> _Stored | None:
        raw = self._call(self._r.get, self._k("rec", key_id))
        return None if raw is None else msgspec.json.decode(raw, type=_Stored)

    def lookup(self, key: str, now: float | None = None) -> ApiKey | None:
        if not key.startswith(KEY_PREFIX) or len(key) > 128:
            return None
        digest = key_hash(key)
        key_id = self._call(self._r.get, self._k("hash", digest.hex()))
        stored = None if key_id is None else self._stored(key_id.decode())
        if stored is None or not hmac.compare_digest(stored.hash, digest):
            return None
        record = stored.key
        return record if record.usable(time.time() if now is None else now) else None

    def get(self, key_id: str) -> ApiKey:
        stored = self._stored(key_id)
        if stored is None:
            raise NotFoundError(f"no key with id {key_id!r}")
        return stored.key

    def has_keys(self) -> bool:
        return bool(self._call(self._r.zcard, self._k("ids")))

    def list(self, tenant: str | None = None) -> list[ApiKey]:
        ids = [i.decode() for i in self._call(self._r.zrange, self._k("ids"), 0, -1)]
        keys = [self.get(i) for i in ids]
        return [k for k in keys if tenant is None or k.tenant == tenant]

    def revoke(self, key_id: str, now: float | None = None) -> ApiKey:
        """Revoke a key (idempotent: a revoked key keeps its first revocation time)."""
        when = time.time() if now is None else now
        rec = self._k("rec", key_id)

        def write(pipe: Any) -> None:
            raw = pipe.get(rec)
            if raw is None:
                raise NotFoundError(f"no key with id {key_id!r}")
            stored = msgspec.json.decode(raw, type=_Stored)
            if stored.key.revoked_at is None:
                stored = _Stored(replace(stored.key, revoked_at=when), stored.hash)
                pipe.multi()
                pipe.set(rec, msgspec.json.encode(stored))

        self._call(self._r.transaction, write, rec)
        return self.get(key_id)

    def rotate(self, key_id: str, now: float | None = None) -> tuple[ApiKey, str]:
        return rotate(self, key_id, now)
