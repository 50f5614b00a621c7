"""Files of the Batch API and the Idempotency-Keys of create calls in Redis (`--redis-url`), shared by
every gateway replica: the same behaviour as batch/files.py (SQLite), which states the invariants;
batch/store_redis.py adds the batches. Keys, under the link's namespace (`ctxfuse:`):

- `batch:seq`                   counter: the order of files and batches (lists are newest first)
- `batch:file:<id>`             hash: seq, owner, purpose, expires_at ("" never), size, idem, object
- `batch:content:<seq>`         hash: piece number -> up to PIECE_BYTES of the content
- `batch:owner-files:<owner>`   sorted set: the owner's file ids by seq
- `batch:expiring-files`        sorted set: ids of files that expire, by expires_at (for sweep)
- `batch:idem:<route>:<key>`    hash: digest, object (id), at (seconds); expires after KEY_TTL_S

A file's fields never change once made (a file is made whole or not at all, and then only deleted).
Content is written in pieces to a staged key that expires (STAGE_TTL_S, so an upload cut short
leaves nothing behind) before the file that names it is made; making the file persists it. Making a
file or batch under an Idempotency-Key is one WATCH/MULTI transaction over the key's record, so two
retries racing each other (on one replica or two) make one object. Every Redis failure is raised as
SharedStateDown (503): a route answers it, the runner waits it out.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import ParamSpec, TypeVar, cast

import msgspec
import redis
from redis.typing import EncodableT, FieldT

from gateway.batch import files
from gateway.batch.files import KEY_REUSED, ContentRef, Idem, KeyReused, new_file
from gateway.encoding import encode
from gateway.shared_state.redis_link import DOWN, RedisLink, SharedStateDown
from shared.batch_protocol import FileObject

PIECE_BYTES = 2**20  # content is stored and read in pieces of this size
STAGE_TTL_S = 3600  # content written for a file (or requests for a batch) not made yet lapses after this
_LIST_PAGE = 100  # ids read at a time while a list is filled
P = ParamSpec("P")
Client = redis.Redis | redis.client.Pipeline  # a pipeline reads at once only while it WATCHes
T = TypeVar("T")

# KEYS: file, content, owner's files, expiring files, idem; ARGV: id, idem key name ("" none)
# -> 1 if this call deleted the file, 0 if it was already gone
_DELETE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[2] ~= '' and redis.call('HGET', KEYS[5], 'object') == ARGV[1] then redis.call('DEL', KEYS[5]) end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return 1
"""


def shared(call: Callable[P, T]) -> Callable[P, T]:
    """The Batch API's store call; an unreachable Redis raises SharedStateDown (503)."""

    @functools.wraps(call)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return call(*args, **kwargs)
        except DOWN as exc:
            raise SharedStateDown("the Batch API", exc) from exc

    return wrapped


def text_of(value: object) -> str:
    """A value Redis answered (bytes; None: no such key or field) as text; "" for None."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def bytes_of(value: object) -> bytes:
    """A value Redis answered as bytes; b"" for None (the client answers bytes: no decode_responses)."""
    return value if isinstance(value, bytes) else b""


Fields = dict[FieldT, EncodableT]  # a hash's fields as written


class RedisFileStore:
    def __init__(
        self, link: RedisLink, clock: Callable[[], float] = time.time, default_ttl_s: int | None = None
    ) -> None:
        """`clock` and `default_ttl_s` as FileStore's."""
        self._link = link
        self._r: redis.Redis = link.sync
        self._clock = clock
        self._default_ttl_s = default_ttl_s
        self._delete = self._r.register_script(_DELETE)

    def close(self) -> None:
        """Nothing of its own to close: the link is the gateway's."""

    # -- key names --------------------------------------------------------------------------------

    def _key(self, *parts: str) -> str:
        return self._link.key("batch", *parts)

    def _file_key(self, file_id: str) -> str:
        return self._key("file", file_id)

    def _content_key(self, seq: int) -> str:
        return self._key("content", str(seq))

    def _idem_key(self, idem: Idem) -> str:
        return self._key("idem", idem.route, idem.key)

    def _next_seq(self) -> int:
        return int(self._r.incr(self._key("seq")))

    # -- idempotency ------------------------------------------------------------------------------

    def _replay(self, client: Client, idem: Idem | None) -> str | KeyReused | None:
        """The object id the key names, KEY_REUSED, or None (new key, past KEY_TTL_S, or none). On a
        pipeline, it reads at once only once the pipeline WATCHes."""
        if idem is None:
            return None
        digest, object_id, at = client.hmget(self._idem_key(idem), ["digest", "object", "at"])
        if digest is None or int(at or 0) < int(time.time()) - files.KEY_TTL_S:
            return None
        return text_of(object_id) if digest == idem.digest else KEY_REUSED

    def _remember(self, pipe: redis.client.Pipeline, idem: Idem | None, object_id: str) -> None:
        """(queued in a MULTI) the key names `object_id` from now on."""
        if idem is not None:
            key = self._idem_key(idem)
            pipe.delete(key)
            pipe.hset(key, mapping={"digest": idem.digest, "object": object_id, "at": int(time.time())})
            pipe.expire(key, max(files.KEY_TTL_S, 1))

    # -- content ----------------------------------------------------------------------------------

    def _stage(self, pieces: Iterable[bytes]) -> tuple[int, int]:
        """Write `pieces` as the content of a file to be made, in PIECE_BYTES parts under a staged key
        that lapses unless a file is made over it; (its seq, its size)."""
        seq = self._next_seq()
        key = self._content_key(seq)
        size, part, buffer = 0, 0, bytearray()

        def flush() -> None:
            nonlocal part
            with self._r.pipeline(transaction=False) as pipe:
                pipe.hset(key, str(part), bytes(buffer))
                pipe.expire(key, STAGE_TTL_S)
                pipe.execute()
            part += 1
            buffer.clear()

        for piece in pieces:
            size += len(piece)
            view = memoryview(piece)
            while view:
                room = PIECE_BYTES - len(buffer)
                buffer += view[:room]
                view = view[room:]
                if len(buffer) == PIECE_BYTES:
                    flush()
        if buffer:
            flush()
        return seq, size

    def _new_file(self, purpose: str, filename: str, size: int, ttl_s: int | None) -> FileObject:
        return new_file(purpose, filename, size, ttl_s or self._default_ttl_s, int(self._clock()))

    def _make_file(
        self, pipe: redis.client.Pipeline, f: FileObject, seq: int, owner: str, idem: Idem | None
    ) -> None:
        """(queued in a MULTI) the file over the content staged at `seq`."""
        fields: Fields = {
            "seq": seq,
            "owner": owner,
            "purpose": f.purpose,
            "expires_at": "" if f.expires_at is None else f.expires_at,
            "size": f.bytes,
            "idem": "" if idem is None else self._idem_key(idem),
            "object": encode(f),
        }
        pipe.hset(self._file_key(f.id), mapping=fields)
        pipe.persist(self._content_key(seq))
        pipe.zadd(self._key("owner-files", owner), {f.id: seq})
        if f.expires_at is not None:
            pipe.zadd(self._key("expiring-files"), {f.id: f.expires_at})
        self._remember(pipe, idem, f.id)

    # -- files ------------------------------------------------------------------------------------

    @shared
    def put_file(
        self,
        purpose: str,
        filename: str,
        content: bytes,
        idem: Idem | None = None,
        ttl_s: int | None = None,
        *,
        owner: str,
    ) -> FileObject | KeyReused:
        """A new file expiring `ttl_s` after its creation (None: the store's default)."""
        early = self._replayed_file(self._r, idem)  # a retry replays without writing the content again
        if early is not None:
            return early
        seq, size = self._stage(content[i : i + PIECE_BYTES] for i in range(0, len(content), PIECE_BYTES))
        f = self._new_file(purpose, filename, size, ttl_s)
        while True:
            with self._r.pipeline() as pipe:
                try:
                    if idem is not None:
                        pipe.watch(self._idem_key(idem))
                    found = self._replayed_file(pipe, idem)
                    if found is not None:
                        self._r.delete(self._content_key(seq))
                        return found
                    pipe.multi()
                    self._make_file(pipe, f, seq, owner, idem)
                    pipe.execute()
                    return f
                except redis.WatchError:
                    continue  # a racing call wrote the key: read what it made

    def _replayed_file(self, client: Client, idem: Idem | None) -> FileObject | KeyReused | None:
        replay = self._replay(client, idem)
        if replay is None or isinstance(replay, KeyReused):
            return replay
        return self._live(client, replay)  # None: the key's file expired or went, the key goes with it

    def _fields(self, client: Client, file_id: str) -> list[bytes | None]:
        """seq, owner, expires_at, size, idem, object; all None if no such file."""
        names = ["seq", "owner", "expires_at", "size", "idem", "object"]
        return [v if isinstance(v, bytes) else None for v in client.hmget(self._file_key(file_id), names)]

    def _is_live(self, expires_at: bytes | None) -> bool:
        return not expires_at or int(expires_at) > self._clock()

    def _live(self, client: Client, file_id: str, owner: str | None = None) -> FileObject | None:
        _, who, expires_at, _, _, obj = self._fields(client, file_id)
        if obj is None or (owner is not None and text_of(who) != owner) or not self._is_live(expires_at):
            return None
        return msgspec.json.decode(obj, type=FileObject)

    @shared
    def get_file(self, file_id: str, owner: str | None = None) -> FileObject | None:
        return self._live(self._r, file_id, owner)

    @shared
    def content_ref(self, file_id: str, owner: str | None = None) -> ContentRef | None:
        """Where a file's content is, to read it in pieces (read_content); None if no such file."""
        seq, who, expires_at, size, _, _ = self._fields(self._r, file_id)
        if seq is None or (owner is not None and text_of(who) != owner) or not self._is_live(expires_at):
            return None
        return ContentRef(int(seq), int(size or 0))

    @shared
    def read_content(self, ref: ContentRef, offset: int, size: int) -> bytes | None:
        """Up to `size` bytes of the content at `offset`; None once the file is deleted."""
        end = min(offset + size, ref.size)
        if end <= offset:
            return b""
        first, last = offset // PIECE_BYTES, (end - 1) // PIECE_BYTES
        parts = self._r.hmget(self._content_key(ref.row), [str(i) for i in range(first, last + 1)])
        if any(p is None for p in parts):
            return None
        joined = b"".join(bytes_of(p) for p in parts)
        start = offset - first * PIECE_BYTES
        return joined[start : start + end - offset]

    def file_content(self, file_id: str) -> bytes | None:
        ref = self.content_ref(file_id)
        return None if ref is None else self.read_content(ref, 0, ref.size)

    @shared
    def list_files(
        self, limit: int, after: str | None, purpose: str | None, *, owner: str
    ) -> list[FileObject]:
        """Newest first, after the file `after` (a cursor); one more than `limit` tells there are more."""
        found: list[FileObject] = []
        for file_id in self._newest_first(self._key("owner-files", owner), after, self._file_key):
            f = self._live(self._r, file_id)
            if f is not None and (purpose is None or f.purpose == purpose):
                found.append(f)
                if len(found) > limit:
                    break
        return found

    def _newest_first(self, zset: str, after: str | None, key_of: Callable[[str], str]) -> Iterator[str]:
        """The ids in `zset` newest first, those older than `after` when given (an unknown cursor pages
        from nothing, as OpenAI's does), read a page at a time."""
        top: str = "+inf"
        if after is not None:
            seq = self._r.hget(key_of(after), "seq")
            if seq is None:
                return
            top = f"({int(seq)}"
        while True:
            got = self._r.zrevrangebyscore(zset, top, "-inf", start=0, num=_LIST_PAGE, withscores=True)
            page = cast(list[tuple[bytes, float]], got)
            for member, _ in page:
                yield text_of(member)
            if len(page) < _LIST_PAGE:
                return
            top = f"({int(page[-1][1])}"  # (scores are seqs: whole numbers)

    @shared
    def delete_file(self, file_id: str, *, owner: str) -> bool:
        seq, who, expires_at, _, _, _ = self._fields(self._r, file_id)
        if seq is None or text_of(who) != owner or not self._is_live(expires_at):
            return False
        return self._drop(file_id)

    def _drop(self, file_id: str) -> bool:
        """Delete the file, its content and the key naming it; False if it was already gone."""
        seq, who, _, _, idem, _ = self._fields(self._r, file_id)
        if seq is None:
            return False
        keys = [
            self._file_key(file_id),
            self._content_key(int(seq)),
            self._key("owner-files", text_of(who)),
            self._key("expiring-files"),
            text_of(idem) or self._key("no-key"),
        ]
        return bool(self._delete(keys=keys, args=[file_id, text_of(idem)]))

    @shared
    def sweep(self) -> int:
        """Delete the files that have expired (with the keys naming them); how many went. Replicas may
        sweep at once: each file is counted by the one that deleted it."""
        now = self._clock()
        expired = self._r.zrangebyscore(self._key("expiring-files"), "-inf", now)
        return sum(self._drop(text_of(i)) for i in expired)
