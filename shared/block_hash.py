"""How a prompt's KV blocks are named: a chain of 16-byte digests, each over its parent's digest, the
block's token ids and an extra key (the tenant's cache salt, an image's content hash). The engine's
block pool and the fleet router, which keys prompts to workers without an engine, hash the same way
(shared/fleet_protocol.py HASH_SCHEME)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def salt_key(cache_salt: str | None) -> bytes:
    """What a request's cache salt mixes into every block hash (SamplingParams.cache_salt): requests
    with different salts never share a cached block. The fleet router hashes with the same bytes."""
    return b"" if cache_salt is None else b"salt:" + cache_salt.encode()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: bytes = b"") -> BlockHash:
    """Chain the parent block's hash, this block's tokens and an extra key into a 16-byte digest."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_key)
    return h.digest()
