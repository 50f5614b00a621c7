"""An app's OpenAI request as an edge request: each long string cut into content-defined chunks
named by digest, with the bytes only of chunks the gateway is not known to hold (zstd)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.chunking import digest, split
from shared.compression import compress
from shared.edge_protocol import EdgeRequest, text_ref

Endpoint = Literal["chat.completions", "completions"]


@dataclass(slots=True)
class Outgoing:
    request: EdgeRequest
    chunks: dict[bytes, bytes] = field(default_factory=dict)  # every chunk named: digest -> plain bytes

    @property
    def digests(self) -> list[bytes]:
        return list(self.chunks)

    def attach(self, digests: list[bytes]) -> None:
        """Carry these chunks' bytes too (the gateway said it lacks them)."""
        for d in digests:
            self.request.chunks[d] = compress(self.chunks[d])


class ChunkMemo:
    """Recently chunked strings by a digest of their bytes: apps resend the same long context with
    each question, and hashing a string once is cheaper than cutting and naming its chunks again."""

    def __init__(self, size: int = 32) -> None:
        self._size = size
        self._seen: OrderedDict[bytes, tuple[list[bytes], list[bytes]]] = OrderedDict()

    def chunks(self, data: bytes) -> tuple[list[bytes], list[bytes]]:
        """(digests, pieces) of `data`."""
        key = hashlib.blake2b(data, digest_size=32).digest()
        hit = self._seen.get(key)
        if hit is not None:
            self._seen.move_to_end(key)
            return hit
        pieces = split(data)
        result = ([digest(p) for p in pieces], pieces)
        self._seen[key] = result
        if len(self._seen) > self._size:
            self._seen.popitem(last=False)
        return result


def chunk_strings(endpoint: Endpoint, body: Any, threshold: int, memo: ChunkMemo | None = None) -> Outgoing:
    """The edge request for `body`, carrying no chunk bytes yet."""
    texts: list[list[bytes]] = []
    chunks: dict[bytes, bytes] = {}
    memo = memo or ChunkMemo(0)

    def walk(value: Any) -> Any:
        if isinstance(value, str):
            data = value.encode("utf-8")
            if len(data) < threshold:
                return value
            names, pieces = memo.chunks(data)
            chunks.update(zip(names, pieces, strict=True))
            texts.append(names)
            return text_ref(len(texts) - 1)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return Outgoing(EdgeRequest(endpoint=endpoint, body=walk(body), texts=texts), chunks)
