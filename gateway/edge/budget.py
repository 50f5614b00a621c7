"""How far one edge request may expand: never past the body limit a plain request meets on the
OpenAI port (GatewayConfig.max_body_bytes), so the edge link is no way around it.

A few bytes on the link can stand for many: a 32-byte digest names a chunk of up to 64 KiB, a
digest may be named again and again, a 6-byte reference in the body puts a whole text there, and a
zstd frame of a few bytes can decompress to a full chunk. Each is counted as the request is
resolved, as many times as it is repeated, and the request is refused (413) the moment the running
total passes the limit, before anything more is decompressed or read: chunks the request carries as
they are decompressed, the chunks it names by their stored size before any chunk's bytes are read.

The number of references is bounded too, before the store is asked anything, so that a request
cannot make the gateway look up (or a 409 answer about) more digests than a legitimate request of
the same expanded size could name.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.errors import RequestTooLargeError
from shared.chunking import MIN_SIZE
from shared.edge_protocol import EdgeRequest


class ExpandedTooLargeError(RequestTooLargeError):
    """The edge request, expanded, would be larger than a plain request may be (413). The message
    names the limit, never how far the expansion got: that would tell a device the size of chunks
    that others sent."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="too_large")


def max_refs(limit: int) -> int:
    """The most chunk references a legitimate request that expands to `limit` bytes names.

    Every chunk of a text but its last holds at least MIN_SIZE bytes, and the agent chunks only
    strings of at least its threshold (2 KiB by default, never below MIN_SIZE in practice), so a
    text of n bytes names at most n / MIN_SIZE + 1 <= 2n / MIN_SIZE chunks.
    """
    return 2 * limit // MIN_SIZE


def check_ref_count(req: EdgeRequest, limit: int) -> None:
    refs = sum(len(text) for text in req.texts)
    if refs > max_refs(limit):
        raise ExpandedTooLargeError(
            f"this request names {refs} chunks; at most {max_refs(limit)} fit the limit of {limit} bytes "
            "for a request body"
        )


@dataclass(slots=True)
class ExpansionBudget:
    """A running count of expanded bytes against the limit; `add` refuses as soon as it is passed."""

    limit: int
    used: int = 0

    def add(self, nbytes: int, what: str = "the expanded size of this request") -> None:
        self.used += nbytes
        if self.used > self.limit:
            raise ExpandedTooLargeError(f"{what} exceeds the limit of {self.limit} bytes for a request body")
