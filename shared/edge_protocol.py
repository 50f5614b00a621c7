"""The edge link's wire types (msgpack, between the edge agent and the gateway's mTLS listener).

An app's OpenAI request travels as its JSON value with each long string replaced by a reference to
an ordered list of content-defined chunks (shared/chunking.py). The agent sends the bytes only of
chunks it does not know the gateway holds, zstd-compressed; the gateway puts the strings back, byte
for byte, and serves the request as if the app had called it directly. A request naming a chunk the
gateway lacks is answered 409 with the missing digests (MissingChunks); the agent sends them and
retries once. Expanded (each digest counted as often as it is named, each text as often as the body
puts it), a request may be no larger than a plain request to the gateway's OpenAI port: past that
it is refused with 413 as it expands (gateway/edge/budget.py).

Long strings are marked with a msgpack extension type, so no JSON value an app sends can be mistaken
for one.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct

CHUNKED_TEXT_EXT = 1  # msgpack ext code: Ext(1, index as 4 big-endian bytes) stands for texts[index]
DIGEST_BYTES = 32  # BLAKE2b-256
MSGPACK = "application/msgpack"


class EdgeRequest(Struct, kw_only=True):
    endpoint: Literal["chat.completions", "completions"]
    # the OpenAI request body, each long string replaced by Ext(CHUNKED_TEXT_EXT, index)
    body: Any
    texts: list[list[bytes]]  # per long string: the digests of its chunks, in order
    chunks: dict[bytes, bytes] = msgspec.field(default_factory=dict)  # digest -> zstd frame of its bytes


class MissingChunks(Struct, kw_only=True):
    """The 409 body: an OpenAI error plus the hex digests the gateway does not hold."""

    error: dict[str, Any]
    missing: list[str]


def text_ref(index: int) -> msgspec.msgpack.Ext:
    return msgspec.msgpack.Ext(CHUNKED_TEXT_EXT, index.to_bytes(4, "big"))


def ref_index(ext: msgspec.msgpack.Ext) -> int | None:
    """The text index an extension value stands for, or None if it is not one of ours."""
    data = bytes(ext.data)
    if ext.code != CHUNKED_TEXT_EXT or len(data) != 4:
        return None
    return int.from_bytes(data, "big")
