"""The gateway's side of the edge link: store the chunks a request carries, find the ones it names
but the store lacks, and put the app's long strings back, byte for byte.

Order matters for "never lost work": a request's new chunks are stored before anything else is
checked, so a retry after a 409 (or a failure further on) needs only what was still missing.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.compression import ChunkError, decompress
from shared.edge_protocol import DIGEST_BYTES, EdgeRequest, ref_index
from shared.errors import CtxfuseError, InvalidRequestError

from .chunk_store import ChunkStore

MAX_CHUNK_BYTES = 64 * 1024  # decompressed; the agent's chunker cuts at 8 KiB


class MissingChunksError(CtxfuseError):
    """The request names chunks the gateway does not hold (409): the agent sends them and retries."""

    status = 409
    type = "invalid_request_error"

    def __init__(self, missing: list[bytes]) -> None:
        super().__init__(
            f"{len(missing)} chunk(s) of this request are not held here; send them and retry",
            code="missing_chunks",
        )
        self.missing = missing

    def to_openai(self) -> dict[str, Any]:
        body = super().to_openai()
        body["missing"] = [d.hex() for d in self.missing]
        return body


def store_new_chunks(store: ChunkStore, req: EdgeRequest) -> int:
    """Check and store the chunks the request carries; returns their decompressed bytes."""
    plain: dict[bytes, bytes] = {}
    for key, frame in req.chunks.items():
        if len(key) != DIGEST_BYTES:
            raise InvalidRequestError(f"a chunk digest must be {DIGEST_BYTES} bytes", param="chunks")
        try:
            data = decompress(frame, MAX_CHUNK_BYTES)
        except ChunkError as exc:
            raise InvalidRequestError(f"chunk {key.hex()} is not valid: {exc}", param="chunks") from None
        plain[key] = data
    # the store checks each digest (refusing all, storing none, on a mismatch); the chunks the
    # request refers to are touched in the same call, so storing these cannot evict those
    store.put_many(plain, touch=_wanted(req))
    return sum(len(d) for d in plain.values())


def _wanted(req: EdgeRequest) -> list[bytes]:
    return list(dict.fromkeys(d for text in req.texts for d in text))


def expand(store: ChunkStore, req: EdgeRequest) -> Any:
    """The app's request body with every chunked string put back; MissingChunksError if the store
    lacks some chunk (after storing the ones the request carried)."""
    wanted = _wanted(req)
    chunks = store.get_many(wanted)
    missing = [d for d in wanted if d not in chunks]
    if missing:
        raise MissingChunksError(missing)
    texts = []
    for i, text in enumerate(req.texts):
        try:
            texts.append(b"".join(chunks[d] for d in text).decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidRequestError(f"chunked text {i} is not UTF-8", param="texts") from None
    return _put_back(req.body, texts)


def _put_back(value: Any, texts: list[str]) -> Any:
    if isinstance(value, msgspec.msgpack.Ext):
        index = ref_index(value)
        if index is None or index >= len(texts):
            raise InvalidRequestError("the body refers to a chunked text it does not list", param="body")
        return texts[index]
    if isinstance(value, dict):
        return {k: _put_back(v, texts) for k, v in value.items()}
    if isinstance(value, list):
        return [_put_back(v, texts) for v in value]
    return value
