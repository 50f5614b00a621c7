"""What the router replicas tell one another through Redis (`--redis-url`): which prefixes each just
sent where, and which canaries were rolled back.

- Prefix affinity. A ctxfuse worker reports its own blocks (health.py reads each worker's event log
  from its own cursor), so every replica's index converges on the truth by itself. But a replica also
  remembers what it has just sent (Fleet.remember), before any report, and that is all it ever knows
  of an OpenAI-compatible server's cache. Each such note is published on one channel and every other
  replica adds it to its index, so a conversation spread over replicas by a load balancer still
  lands on the backend holding its prefix.
- Canary rollbacks. A replica that rolls a canary back publishes the verdict and keeps it in a Redis
  hash; every replica applies it on receipt, and a replica that starts (or reconnects) reads the hash
  first, so a rolled-back canary gets no traffic from any replica, and a restart does not revive it.

Redis down: routing goes on from each replica's own state (affinity by its own notes and the workers'
reports; rollbacks decided locally); the subscriber reconnects every RETRY_S and re-reads the
rollbacks. Messages are advisory: a lost one costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import structlog

from gateway.backends.fleet.canary import Rollback
from gateway.shared_state.redis_link import DOWN, RedisLink, Unawaited

if TYPE_CHECKING:
    from gateway.backends.fleet.fleet import Fleet

log = structlog.get_logger("ctxfuse.gateway")

RETRY_S = 2.0


class Remembered(msgspec.Struct, tag="remembered"):
    backend: str
    keys: list[bytes]


class RolledBack(msgspec.Struct, tag="rolled_back"):
    rollback: Rollback


class Note(msgspec.Struct):
    sender: str  # the replica that sent it (its own notes are skipped)
    body: Remembered | RolledBack


_decode = msgspec.msgpack.Decoder(Note)
_rollback = msgspec.msgpack.Decoder(Rollback)


class FleetSync:
    def __init__(self, fleet: Fleet, link: RedisLink) -> None:
        self._fleet = fleet
        self._link = link
        self._channel = link.key("fleet", "notes")
        self._rollbacks = link.key("fleet", "rolled_back")
        self._unawaited = Unawaited("fleet_note_lost")
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()  # subscribed, and the stored rollbacks applied

    # -- this replica's notes -------------------------------------------------------------------

    def remembered(self, backend: str, keys: Sequence[bytes]) -> None:
        self._unawaited.send(self._publish(Remembered(backend, list(keys))))

    def rolled_back(self, rollback: Rollback) -> None:
        async def keep_and_tell() -> None:
            await self._link.aio.hsetnx(self._rollbacks, rollback.version, msgspec.msgpack.encode(rollback))
            await self._publish(RolledBack(rollback))

        self._unawaited.send(keep_and_tell())

    async def _publish(self, body: Remembered | RolledBack) -> None:
        note = Note(self._link.replica, body)
        await self._link.aio.publish(self._channel, msgspec.msgpack.encode(note))

    # -- the others' ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._listen(), name="fleet-sync")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._unawaited.tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _listen(self) -> None:
        while True:
            try:
                await self._subscribed()
            except DOWN as exc:
                self.connected.clear()
                log.warning("fleet_sync_down", error=type(exc).__name__, retry_s=RETRY_S)
            await asyncio.sleep(RETRY_S)

    async def _subscribed(self) -> None:
        pubsub = self._link.aio.pubsub()
        try:
            await pubsub.subscribe(self._channel)
            stored = await self._link.aio.hgetall(self._rollbacks)
            for raw in stored.values():
                self._adopt(_rollback.decode(raw if isinstance(raw, bytes) else raw.encode()))
            self.connected.set()
            async for message in pubsub.listen():
                if message.get("type") == "message":
                    data = message["data"]
                    self._apply(data if isinstance(data, bytes) else data.encode())
        finally:
            await pubsub.aclose()

    def _apply(self, raw: bytes) -> None:
        try:
            note = _decode.decode(raw)
        except msgspec.DecodeError:
            return  # not ours (another program on the channel): ignored
        if note.sender == self._link.replica:
            return
        body = note.body
        if isinstance(body, Remembered):
            self._fleet.index.add(body.backend, body.keys)
            self._fleet.metrics.index_keys.set(len(self._fleet.index))
        else:
            self._adopt(body.rollback)

    def _adopt(self, rollback: Rollback) -> None:
        if self._fleet.canary.adopt(rollback):
            self._fleet.adopted_rollback(rollback)
