"""Stored responses in Redis (`--redis-url`), so that a conversation continued with
`previous_response_id` finds its response whichever replica the load balancer picks. Same rules as
openai/response_store.py: owned by a tenant (another tenant's id is not found), `store: false` keeps
only the id, so naming it later is a clear 400.

One hash per response, `responses:<tenant>:<id>` = {stored, response, input_items}. Unlike the SQLite
file, a Redis is memory: a stored response lapses after RESPONSE_TTL_S (OpenAI keeps them 30 days).
Unreachable Redis: SharedStateDown (503).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.openai.response_store import NotStored, Stored, decode_stored
from gateway.shared_state.redis_link import DOWN, RedisLink, SharedStateDown
from shared.responses_protocol import Item, Response

RESPONSE_TTL_S = 30 * 24 * 3600
# delete only a response that was stored (one made with store=false is not the caller's to delete)
_DELETE_STORED = (
    "if redis.call('HGET', KEYS[1], 'stored') == '1' then return redis.call('DEL', KEYS[1]) end return 0"
)


class RedisResponseStore:
    def __init__(self, link: RedisLink) -> None:
        self._link = link
        self._r = link.sync

    def _key(self, tenant: str, response_id: str) -> str:
        return self._link.key("responses", tenant, response_id)

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except DOWN as exc:
            raise SharedStateDown("stored responses", exc) from exc

    def put(self, tenant: str, response: Response, input_items: list[Item]) -> None:
        fields: dict[str, bytes | int] = {"stored": int(response.store)}
        if response.store:
            fields |= {
                "response": msgspec.json.encode(response),
                "input_items": msgspec.json.encode(input_items),
            }
        key = self._key(tenant, response.id)
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
        pipe.expire(key, RESPONSE_TTL_S)
        self._call(pipe.execute)

    def get(self, tenant: str, response_id: str) -> Stored | NotStored | None:
        row = self._call(self._r.hmget, self._key(tenant, response_id), ["stored", "response", "input_items"])
        if row[0] is None:
            return None
        return decode_stored(int(row[0]), row[1], row[2])

    def response_json(self, tenant: str, response_id: str) -> bytes | None:
        stored, response = self._call(self._r.hmget, self._key(tenant, response_id), ["stored", "response"])
        return response if stored is not None and int(stored) else None

    def delete(self, tenant: str, response_id: str) -> bool:
        key = self._key(tenant, response_id)
        deleted = self._call(self._r.eval, _DELETE_STORED, 1, key)
        return bool(deleted)

    def close(self) -> None:
        pass  # the link is the gateway's
