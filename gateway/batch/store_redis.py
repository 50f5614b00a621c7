"""Batches of the Batch API and their requests with results in Redis (`--redis-url`), beside the
files (batch/files_redis.py): the same behaviour as batch/store.py (SQLite), whose invariants hold
here too, for every replica at once. Keys, under `ctxfuse:batch:`:

- `batch:<id>`                hash: seq, owner, status, output_ttl_s ("" none), object (the Batch)
- `counts:<id>`               hash: total, completed, failed (request_counts, read with the batch)
- `requests:<id>`             hash: line -> msgpack [custom_id, body]
- `done:<id>`, `failed:<id>`  hashes: line -> the result's output line (ok, or not)
- `owner-batches:<owner>`     sorted set: the owner's batch ids by seq
- `active`                    sorted set: ids of batches the runners have work on, by seq

Writes that must not race are atomic: a result is stored by one Lua script (only if the line is a
request of the batch with no result yet, and its count with it), so of two replicas that ran one
request only the first stores; a status change is a WATCH/MULTI transaction on the batch's hash;
`start` stages the requests in pieces and moves them in with the status change; `finish` writes the
output and error files from the stored results (pieces of content, staged) and then makes them with
the final status in one transaction, which is abandoned and redone if a result arrived meanwhile, so
the files always hold every counted result. Which replica drives a batch is batch/lease.py's.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator

import msgspec
import redis

from gateway.batch.files import Idem, KeyReused
from gateway.batch.files_redis import STAGE_TTL_S, Fields, RedisFileStore, bytes_of, shared, text_of
from gateway.batch.input import BatchItem
from gateway.batch.store import ACTIVE, new_batch
from gateway.encoding import encode
from gateway.shared_state.redis_link import RedisLink
from shared.batch_protocol import (
    Batch,
    BatchCreateRequest,
    BatchErrors,
    BatchStatus,
    FileObject,
)

_PAGE = 64  # results (or requests) read or written at a time
_RESULT_HASH = {True: "done", False: "failed"}

# KEYS: requests, done, failed, counts; ARGV: line, result, ok ('1' | '0')
# -> 1 stored | 0 the line already has a result, or is no request of the batch
_PUT_RESULT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  return 0
end
if ARGV[3] == '1' then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  redis.call('HINCRBY', KEYS[4], 'completed', 1)
else
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
  redis.call('HINCRBY', KEYS[4], 'failed', 1)
end
return 1
"""


class Stale:
    """More results were stored than a finish was written for: it is written again."""


STALE = Stale()


class RedisBatchStore(RedisFileStore):
    def __init__(
        self, link: RedisLink, clock: Callable[[], float] = time.time, default_ttl_s: int | None = None
    ) -> None:
        super().__init__(link, clock, default_ttl_s)
        self._put_result = self._r.register_script(_PUT_RESULT)

    def _bkey(self, kind: str, batch_id: str) -> str:
        return self._key(kind, batch_id)

    # -- batches ----------------------------------------------------------------------------------

    @shared
    def create_batch(
        self, req: BatchCreateRequest, idem: Idem | None = None, *, owner: str
    ) -> Batch | KeyReused:
        now = int(time.time())
        b, ttl_s = new_batch(req, now)
        seq = self._next_seq()
        while True:
            with self._r.pipeline() as pipe:
                try:
                    if idem is not None:
                        pipe.watch(self._idem_key(idem))
                    replay = self._replay(pipe, idem)
                    if isinstance(replay, KeyReused):
                        return replay
                    if replay is not None:
                        found = self._batch(replay)
                        if found is not None:  # (batches are never deleted, so a key's batch is there)
                            return found
                    pipe.multi()
                    fields: Fields = {
                        "seq": seq,
                        "owner": owner,
                        "status": b.status,
                        "output_ttl_s": "" if ttl_s is None else ttl_s,
                        "object": encode(b),
                    }
                    pipe.hset(self._bkey("batch", b.id), mapping=fields)
                    pipe.zadd(self._key("owner-batches", owner), {b.id: seq})
                    pipe.zadd(self._key("active"), {b.id: seq})
                    self._remember(pipe, idem, b.id)
                    pipe.execute()
                    return b
                except redis.WatchError:
                    continue  # a racing call wrote the key: read what it made

    def _batch(self, batch_id: str, owner: str | None = None) -> Batch | None:
        """The batch with its request_counts, read together in one transaction."""
        with self._r.pipeline() as pipe:
            pipe.hmget(self._bkey("batch", batch_id), ["object", "owner"])
            pipe.hmget(self._bkey("counts", batch_id), ["total", "completed", "failed"])
            (obj, who), counts = pipe.execute()
        if obj is None or (owner is not None and text_of(who) != owner):
            return None
        b = msgspec.json.decode(obj, type=Batch)
        total, done, failed = (int(c or 0) for c in counts)
        b.request_counts.total, b.request_counts.completed, b.request_counts.failed = total, done, failed
        return b

    @shared
    def get_batch(self, batch_id: str, owner: str | None = None) -> Batch | None:
        return self._batch(batch_id, owner)

    @shared
    def owner_of(self, batch_id: str) -> str:
        """The tenant that created the batch."""
        who = self._r.hget(self._bkey("batch", batch_id), "owner")
        if who is None:
            raise KeyError(batch_id)
        return text_of(who)

    @shared
    def list_batches(self, limit: int, after: str | None, *, owner: str) -> list[Batch]:
        found: list[Batch] = []
        ids = self._newest_first(self._key("owner-batches", owner), after, lambda i: self._bkey("batch", i))
        for batch_id in ids:
            b = self._batch(batch_id)
            if b is not None:
                found.append(b)
            if len(found) > limit:
                break
        return found

    def next_active(self) -> Batch | None:
        """The oldest batch the runners have work on."""
        ids = self.active_ids(1, frozenset())
        return self.get_batch(ids[0]) if ids else None

    @shared
    def active_ids(self, limit: int, skip: frozenset[str]) -> list[str]:
        """Up to `limit` ids of batches the runners have work on, oldest first, leaving out `skip`."""
        # the first limit + |skip| of the set hold the answer: never read all of a long queue
        ids = [text_of(i) for i in self._r.zrange(self._key("active"), 0, limit + len(skip) - 1)]
        return [i for i in ids if i not in skip][:limit]

    @shared
    def transition(
        self,
        batch_id: str,
        status: BatchStatus,
        *,
        only_from: tuple[BatchStatus, ...] = ACTIVE,
        owner: str | None = None,
        **fields: object,
    ) -> Batch | None:
        """Move the batch to `status` (stamping `<status>_at`) if it is in one of `only_from` (and
        `owner`'s, when given); None if not."""
        b = self._transition(batch_id, status, only_from, fields, owner)
        return None if isinstance(b, Stale) else b

    def _transition(
        self,
        batch_id: str,
        status: BatchStatus,
        only_from: tuple[BatchStatus, ...],
        fields: dict[str, object],
        owner: str | None = None,
        also: Callable[[redis.client.Pipeline, str], None] | None = None,
        counted: tuple[int, int] | None = None,
    ) -> Batch | Stale | None:
        """The status change as one transaction on the batch's hash, with what `also` queues into it
        (given the pipeline and the batch's owner). `counted`: the results (completed, failed) the
        change was made for; STALE if more have been stored since."""
        key, counts = self._bkey("batch", batch_id), self._bkey("counts", batch_id)
        while True:
            with self._r.pipeline() as pipe:
                try:
                    pipe.watch(key, counts)
                    b = self._batch(batch_id, owner)
                    if b is None or b.status not in only_from:
                        return None
                    if counted is not None and counted != (
                        b.request_counts.completed,
                        b.request_counts.failed,
                    ):
                        return STALE
                    b.status = status
                    setattr(b, f"{status}_at", int(time.time()))
                    for name, value in fields.items():
                        setattr(b, name, value)
                    batch_owner = text_of(self._r.hget(key, "owner"))
                    pipe.multi()
                    if also is not None:
                        also(pipe, batch_owner)
                    pipe.hset(key, mapping={"status": status, "object": encode(b)})
                    if status not in ACTIVE:
                        pipe.zrem(self._key("active"), batch_id)
                    pipe.execute()
                    return b
                except redis.WatchError:
                    continue  # changed meanwhile (a cancel, a result): decide again on what it is now

    def fail_validation(self, batch_id: str, errors: BatchErrors) -> Batch | None:
        return self.transition(batch_id, "failed", only_from=("validating",), errors=errors)

    @shared
    def start(self, batch_id: str, items: list[BatchItem]) -> Batch | None:
        """validating -> in_progress with the batch's requests stored, in one transaction (the requests
        are staged first, a page at a time, and moved in with the status change)."""
        staged = self._bkey("requests-staged", batch_id)
        self._r.delete(staged)
        for i in range(0, len(items), _PAGE):
            page = {str(x.line): msgspec.msgpack.encode((x.custom_id, x.body)) for x in items[i : i + _PAGE]}
            with self._r.pipeline(transaction=False) as pipe:
                pipe.hset(staged, mapping=page)  # type: ignore[arg-type]
                pipe.expire(staged, STAGE_TTL_S)
                pipe.execute()
        requests, counts = self._bkey("requests", batch_id), self._bkey("counts", batch_id)

        def move_in(pipe: redis.client.Pipeline, _owner: str) -> None:
            if items:
                pipe.rename(staged, requests)
                pipe.persist(requests)
            pipe.hset(counts, "total", len(items))

        b = self._transition(batch_id, "in_progress", ("validating",), {}, also=move_in)
        if not isinstance(b, Batch):
            self._r.delete(staged)
            return None
        b.request_counts.total = len(items)
        return b

    @shared
    def pending(self, batch_id: str) -> list[BatchItem]:
        with self._r.pipeline() as pipe:
            pipe.hgetall(self._bkey("requests", batch_id))
            pipe.hkeys(self._bkey("done", batch_id))
            pipe.hkeys(self._bkey("failed", batch_id))
            requests, done, failed = pipe.execute()
        have = {int(x) for x in (*done, *failed)}
        items = []
        for line, packed in requests.items():
            if int(line) not in have:
                custom_id, body = msgspec.msgpack.decode(packed, type=tuple[str, bytes])
                items.append(BatchItem(int(line), custom_id, body))
        return sorted(items, key=lambda x: x.line)

    @shared
    def put_result(self, batch_id: str, line: int, ok: bool, result: bytes) -> bool:
        """Store a request's output line; False if it already had one (it is never overwritten)."""
        keys = [self._bkey(k, batch_id) for k in ("requests", "done", "failed", "counts")]
        return bool(self._put_result(keys=keys, args=[line, result, "1" if ok else "0"]))

    @shared
    def finish(self, batch_id: str, status: BatchStatus, errors: BatchErrors | None = None) -> Batch | None:
        """Write the output and error files from the stored results (in input order) and set the final
        status in one transaction; redone from the start if a result is stored meanwhile."""
        while True:
            b = self._batch(batch_id)
            if b is None or b.status not in ACTIVE:
                return None
            ttl_s = self._r.hget(self._bkey("batch", batch_id), "output_ttl_s")
            fields: dict[str, object] = {} if errors is None else {"errors": errors}
            made: list[tuple[FileObject, int]] = []
            for ok, name in ((True, "output_file_id"), (False, "error_file_id")):
                lines = sorted(int(x) for x in self._r.hkeys(self._bkey(_RESULT_HASH[ok], batch_id)))
                if lines:
                    seq, size = self._stage(self._results(batch_id, ok, lines))
                    filename = f"{batch_id}_{name[:-8]}.jsonl"
                    f = self._new_file("batch_output", filename, size, int(ttl_s) if ttl_s else None)
                    fields[name] = f.id
                    made.append((f, seq))
            make_files = functools.partial(self._make_files, made)
            counted = (b.request_counts.completed, b.request_counts.failed)
            done = self._transition(batch_id, status, ACTIVE, fields, also=make_files, counted=counted)
            if not isinstance(done, Stale):
                if done is None and made:  # finished meanwhile (elsewhere): what was staged goes
                    self._r.delete(*[self._content_key(seq) for _, seq in made])
                return done
            for _, seq in made:  # a result was stored meanwhile: write the files again
                self._r.delete(self._content_key(seq))

    def _make_files(
        self, made: list[tuple[FileObject, int]], pipe: redis.client.Pipeline, owner: str
    ) -> None:
        for f, seq in made:  # the batch's owner owns its results
            self._make_file(pipe, f, seq, owner, None)

    def _results(self, batch_id: str, ok: bool, lines: list[int]) -> Iterator[bytes]:
        """The stored results at `lines`, each with its newline, read a page at a time."""
        key = self._bkey(_RESULT_HASH[ok], batch_id)
        for i in range(0, len(lines), _PAGE):
            for result in self._r.hmget(key, [str(n) for n in lines[i : i + _PAGE]]):
                yield bytes_of(result)
                yield b"\n"
