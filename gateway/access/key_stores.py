"""Which store holds tenants' keys: Redis when the gateway shares its state (`--redis-url`), else
the data dir's SQLite file."""

from __future__ import annotations

from gateway.access.keys import Keys, KeyStore
from gateway.state import Gateway


def key_store(gateway: Gateway) -> Keys:
    if gateway.redis is not None:
        from gateway.access.keys_redis import RedisKeyStore

        return RedisKeyStore(gateway.redis)
    return KeyStore(gateway.config.data / "keys.sqlite")
