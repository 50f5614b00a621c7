"""The gateway's side of the edge link: store the chunks a request carries, find the ones it names
but the store lacks, and put the app's long strings back, byte for byte.

Order matters for "never lost work": a request's new chunks are stored before anything else is
checked, so a retry after a 409 (or a failure further on) needs only what was still missing.

Both steps run as the caller's tenant (gateway/access/auth.py principal_of): a request may name only
chunks its tenant's devices sent; any other is missing (409), so the device must send its bytes.

Both steps are bounded as they go by the body limit of a plain request (gateway/edge/budget.py):
the carried chunks as they are decompressed, the expanded request by the stored sizes of the chunks
it names, each counted as often as it is named and as often as the body puts its text, before any
chunk's bytes are read.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.edge.budget import ExpansionBudget
from gateway.edge.stores import AnyChunkStore
from shared.compression import ChunkError, decompress
from shared.edge_protocol import DIGEST_BYTES, EdgeRequest, ref_index
from shared.errors import CtxfuseError, InvalidRequestError

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


def store_new_chunks(store: AnyChunkStore, req: EdgeRequest, limit: int, *, tenant: str) -> int:
    """Check and store the chunks the request carries, as `tenant`'s; returns their decompressed
    bytes."""
    named = {d for text in req.texts for d in text}
    budget = ExpansionBudget(limit)
    plain: dict[bytes, bytes] = {}
    for key, frame in req.chunks.items():
        if len(key) != DIGEST_BYTES:
            raise InvalidRequestError(f"a chunk digest must be {DIGEST_BYTES} bytes", param="chunks")
        if key not in named:  # the agent sends only chunks its texts name; nothing else is stored
            raise InvalidRequestError(f"chunk {key.hex()} is not named by any text", param="chunks")
        try:
            data = decompress(frame, MAX_CHUNK_BYTES)
        except ChunkError as exc:
            raise InvalidRequestError(f"chunk {key.hex()} is not valid: {exc}", param="chunks") from None
        budget.add(len(data), "the decompressed size of the chunks this request carries")
        plain[key] = data
    # the store checks each digest (refusing all, storing none, on a mismatch); the chunks the
    # request refers to are touched in the same call, so storing these cannot evict those
    store.put_many(plain, tenant=tenant, touch=_wanted(req))
    return budget.used


def _wanted(req: EdgeRequest) -> list[bytes]:
    return list(dict.fromkeys(d for text in req.texts for d in text))


def expand(store: AnyChunkStore, req: EdgeRequest, limit: int, *, tenant: str) -> Any:
    """The app's request body with every chunked string put back; MissingChunksError if `tenant`
    holds not every chunk it names (after storing the ones the request carried); ExpandedTooLargeError
    (413) as soon as the texts, counted as often as the body puts each, pass `limit` bytes."""
    uses = _text_uses(req)
    wanted = _wanted(req)
    sizes = store.sizes(wanted, tenant=tenant)
    budget = ExpansionBudget(limit)
    missing: dict[bytes, None] = {}  # in request order, each once
    for text, n in zip(req.texts, uses, strict=True):
        for d in text:
            size = sizes.get(d)
            if size is None:
                missing[d] = None
            else:
                budget.add(size * n)
    if missing:
        raise MissingChunksError(list(missing))
    chunks = store.get_many(
        wanted, tenant=tenant
    )  # at most `limit` bytes: each distinct chunk was counted at least once
    lost = [d for d in wanted if d not in chunks]  # evicted since `sizes`, by another request's put
    if lost:
        raise MissingChunksError(lost)
    texts = []
    for i, text in enumerate(req.texts):
        try:
            texts.append(b"".join(chunks[d] for d in text).decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidRequestError(f"chunked text {i} is not UTF-8", param="texts") from None
    return _put_back(req.body, texts)


def _text_uses(req: EdgeRequest) -> list[int]:
    """How many times the body puts each text. Every reference must name a listed text, and every
    listed text must be put somewhere (an unused one would be read for nothing)."""
    uses = [0] * len(req.texts)
    stack = [req.body]
    while stack:  # not recursive: the body is as deep as msgpack decoding allowed
        value = stack.pop()
        if isinstance(value, msgspec.msgpack.Ext):
            index = ref_index(value)
            if index is None or index >= len(uses):
                raise InvalidRequestError("the body refers to a chunked text it does not list", param="body")
            uses[index] += 1
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    if 0 in uses:
        raise InvalidRequestError(f"chunked text {uses.index(0)} is listed but never used", param="texts")
    return uses


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
