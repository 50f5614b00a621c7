"""The block pool owns KV memory bookkeeping: which blocks are free, who holds each one, and which
full blocks hold which token prefix.

- A block is free when its reference count is 0. Free blocks wait in a queue in the order they were
  freed; allocation takes from the front, so the least recently freed block is evicted first.
- A free block may still hold a cached prefix (its hash stays in `cached`): a later request with the
  same prefix takes it back out of the free queue (`touch`) instead of recomputing it. Only when the
  block is reused for other tokens does its hash go.
- "Does not fit" is a value: `allocate` returns None and changes nothing.
- With an event log (block_events.py), every change to `cached` is reported to it as it happens:
  a hash entering is "stored", a hash leaving is "evicted".
- With tiers below it (kv/tiers/offload.py), the blocks an allocation is about to reuse are handed
  to them first, while their KV is intact, and every hash entering `cached` is reported.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from shared.block_hash import BlockHash

if TYPE_CHECKING:
    from cloud.engine.kv.block_events import BlockEventLog


class Tiers(Protocol):
    """What lies below the pool (kv/tiers/offload.py KVTiers)."""

    def stored(self, block_hash: BlockHash, block_id: int) -> None: ...
    def evicting(self, blocks: list[tuple[BlockHash, int]]) -> None: ...


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_prefix_caching: bool = True, events: BlockEventLog | None = None
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}  # block hash -> block id
        self.events = events  # told of every hash that enters or leaves `cached`
        self.tiers: Tiers | None = None  # handed the cached blocks an allocation reuses

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The id of a block caching this prefix, or None."""
        return self.cached.get(block_hash) if self.enable_prefix_caching else None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (reviving them from the free queue if unreferenced)."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self._free[bid]
            block.ref_count += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with one reference each, evicting least recently freed ones; None if too few."""
        if n > len(self._free):
            return None
        if self.tiers is not None:
            self._spill(n)
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            if block.block_hash is not None:  # evict its cached prefix
                if self.cached.get(block.block_hash) == bid:
                    del self.cached[block.block_hash]
                    if self.events is not None:
                        self.events.evicted(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            out.append(bid)
        return out

    def _spill(self, n: int) -> None:
        """Hand the cached blocks among the next n to be reused to the tiers below."""
        going = []
        for bid in itertools.islice(self._free, n):
            h = self.blocks[bid].block_hash
            if h is not None and self.cached.get(h) == bid:
                going.append((h, bid))
        if going and self.tiers is not None:
            self.tiers.evicting(going)

    def forget(self, block_ids: Sequence[int]) -> None:
        """Take the blocks' hashes out of the prefix cache (their bytes are not what the hashes name)."""
        for bid in block_ids:
            block = self.blocks[bid]
            h = block.block_hash
            block.block_hash = None
            if h is not None and self.cached.get(h) == bid:
                del self.cached[h]
                if self.events is not None:
                    self.events.evicted(h)

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. Pass a request's blocks in order: the tail is queued
        first, so a prefix's head (the part other requests most likely share) is evicted last."""
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {bid} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[bid] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that a full block holds the prefix named by block_hash."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        # If another block already caches this prefix, keep the first: both hold the same KV. (No entry
        # names this block yet, its hash was None: getting its id back means the hash went in now.)
        if self.cached.setdefault(block_hash, block_id) == block_id:
            if self.events is not None:
                self.events.stored(block_hash)
            if self.tiers is not None:
                self.tiers.stored(block_hash, block_id)
