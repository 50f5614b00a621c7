"""Stored responses (`store: true`, the default): each response object with the input items it was
made from, owned by the caller's tenant, in one SQLite database under the gateway's data dir.

A response's input items are the whole conversation it answered (a `previous_response_id`'s items
and output, then its own input), so continuing a conversation reads one row. A response made with
`store: false` leaves only its id and tenant (no content), so a later `previous_response_id` naming
it gets a clear 400 rather than a "not found" that hides why.

One connection behind a lock; callers run these methods on a worker thread (asyncio.to_thread).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec
from litestar import Litestar
from litestar.datastructures import State

from shared.responses_protocol import Item, Response
from shared.sqlite_store import open_db

if TYPE_CHECKING:
    from gateway.shared_state.redis_link import RedisLink

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    stored INTEGER NOT NULL,   -- 0: made with store=false, nothing of it kept
    response BLOB,             -- the response object, JSON
    input_items BLOB           -- the conversation it answered, JSON list of items
)
"""

_items = msgspec.json.Decoder(list[Item])
_response = msgspec.json.Decoder(Response)


@dataclass(frozen=True, slots=True)
class NotStored:
    """The response exists but was made with store=false."""


@dataclass(frozen=True, slots=True)
class Stored:
    response: Response
    input_items: list[Item]


class ResponseStore:
    def __init__(self, path: Path) -> None:
        self._db = open_db(path, durable=True, store="responses")
        self._db.execute(_SCHEMA)
        self._lock = threading.Lock()

    def put(self, tenant: str, response: Response, input_items: list[Item]) -> None:
        """Keep `response` (or only its id, when it was made with store=false)."""
        row: tuple[bytes | None, bytes | None] = (None, None)
        if response.store:
            row = (msgspec.json.encode(response), msgspec.json.encode(input_items))
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (response.id, tenant, response.created_at, int(response.store), *row),
            )

    def _row(self, tenant: str, response_id: str) -> tuple[int, bytes | None, bytes | None] | None:
        with self._lock:
            found: tuple[int, bytes | None, bytes | None] | None = self._db.execute(
                "SELECT stored, response, input_items FROM responses WHERE id = ? AND tenant = ?",
                (response_id, tenant),
            ).fetchone()
        return found

    def get(self, tenant: str, response_id: str) -> Stored | NotStored | None:
        """The tenant's response `response_id` (None: none of its responses has that id)."""
        row = self._row(tenant, response_id)
        return None if row is None else decode_stored(*row)

    def response_json(self, tenant: str, response_id: str) -> bytes | None:
        """The stored response object as it was sent (None: not the tenant's, or not stored)."""
        row = self._row(tenant, response_id)
        return row[1] if row is not None and row[0] else None

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            cur = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND tenant = ? AND stored = 1", (response_id, tenant)
            )
        return cur.rowcount > 0

    def close(self) -> None:
        with self._lock:
            self._db.close()


def decode_stored(stored: int, response: bytes | None, items: bytes | None) -> Stored | NotStored:
    if not stored or response is None or items is None:
        return NotStored()
    return Stored(_response.decode(response), _items.decode(items))


class Responses(Protocol):
    """Where stored responses live: this SQLite store, or response_store_redis.py's (replicas)."""

    def put(self, tenant: str, response: Response, input_items: list[Item]) -> None: ...

    def get(self, tenant: str, response_id: str) -> Stored | NotStored | None: ...

    def response_json(self, tenant: str, response_id: str) -> bytes | None: ...

    def delete(self, tenant: str, response_id: str) -> bool: ...

    def close(self) -> None: ...


_open_lock = threading.Lock()


def store_at(state: State, path: Path, redis: RedisLink | None = None) -> Responses:
    """The one store of an app (`state`: its Litestar state), opened on first use: in the Redis the
    replicas share when there is one, else in the SQLite file at `path`."""
    with _open_lock:
        store = state.get("responses")
        if store is None:
            if redis is not None:
                from gateway.openai.response_store_redis import RedisResponseStore

                store = state["responses"] = RedisResponseStore(redis)
            else:
                store = state["responses"] = ResponseStore(path)
        return store


def close_store(app: Litestar) -> None:
    """The app's shutdown hook: close the store if a request opened it (its SQLite connection would
    otherwise live until the process ends, holding the file's WAL open in tests and embedders)."""
    with _open_lock:
        store = app.state.get("responses")
        if store is not None:
            del app.state["responses"]
            store.close()
