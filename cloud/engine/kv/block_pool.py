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
- With local layer groups (kv/layout.py), every block is a page of the global layers and takes one
  companion page per group from the same free queue when it is allocated; `page_map` records them.
  Companions are held apart from their block (`hold_windows` / `release_windows`): a request lets go
  of a block's companion once no query of its own can see the block. An unheld companion waits in
  the free queue like a cached block; when either its pages or its block are reused, the block
  loses its companion (a prefix hit ending there is no longer whole: the manager cuts it shorter).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

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
    companion: tuple[int, ...] | None = None  # its local groups' pages (a block of a windowed model)
    owner: int = -1  # a companion page: the block it belongs to
    window_refs: int = 0  # requests holding its companion


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        events: BlockEventLog | None = None,
        groups: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.groups = groups  # companion pages per block (local layer groups; 0: the plain layout)
        # block -> its companion pages, per group (rows of blocks without one are stale, never read
        # unmasked); the cache reads it, directly or through a device copy fed by `dirty`
        self.page_map = (
            torch.arange(num_blocks, dtype=torch.long).view(-1, 1).repeat(1, groups) if groups else None
        )
        self.dirty: set[int] = set()  # page map rows changed since the cache's copy took them
        self.low_free = num_blocks  # the fewest free blocks seen (a benchmark's peak; reset it at will)
        # companions come from the top of the pages never taken while there are any: the blocks of a
        # fresh pool then lie side by side from 0 up, so their gather stays a view (KVCache.gather)
        self._untaken = [True] * num_blocks
        self._top = num_blocks - 1
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
        self.low_free = min(self.low_free, len(self._free))

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with one reference each, evicting least recently freed ones; None if too few."""
        if n * (1 + self.groups) > len(self._free):
            return None
        if self.tiers is not None:
            self._spill(n)
        out = []
        for _ in range(n):
            bid = self._take()
            if self.groups:
                pages = tuple(self._take_companion() for _ in range(self.groups))
                for p in pages:
                    self.blocks[p].owner = bid
                block = self.blocks[bid]
                block.companion, block.window_refs = pages, 1
                assert self.page_map is not None
                self.page_map[bid] = torch.tensor(pages, dtype=torch.long)
                self.dirty.add(bid)
            out.append(bid)
        self.low_free = min(self.low_free, len(self._free))
        return out

    def _take(self) -> int:
        """The least recently freed page, referenced once, cleared of what it held: its cached prefix,
        its companion, or its part in another block's companion."""
        bid, _ = self._free.popitem(last=False)
        self._untaken[bid] = False
        block = self.blocks[bid]
        if block.block_hash is not None:  # evict its cached prefix
            if self.cached.get(block.block_hash) == bid:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.evicted(block.block_hash)
            block.block_hash = None
        if block.companion is not None:
            self._unlink(bid)
        if block.owner >= 0:
            self._unlink(block.owner)
        block.ref_count = 1
        return bid

    def _take_companion(self) -> int:
        """A page for a companion: the highest never taken (it holds nothing), else as `_take`."""
        while self._top >= 0 and not self._untaken[self._top]:
            self._top -= 1
        if self._top < 0:
            return self._take()
        bid = self._top
        del self._free[bid]
        self._untaken[bid] = False
        self.blocks[bid].ref_count = 1
        return bid

    def _unlink(self, bid: int) -> None:
        """The block loses its companion (unheld: its pages are in the free queue)."""
        block = self.blocks[bid]
        if block.window_refs:
            raise RuntimeError(f"block {bid}'s companion is held but was reused")
        for p in block.companion or ():
            self.blocks[p].owner = -1
        block.companion = None

    def hold_windows(self, block_ids: Iterable[int]) -> None:
        """Take a reference on the blocks' companions (reviving them from the free queue)."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.companion is None:
                raise RuntimeError(f"block {bid} has no companion pages to hold")
            if block.window_refs == 0:
                for p in block.companion:
                    del self._free[p]
                    self.blocks[p].ref_count = 1
            block.window_refs += 1
        self.low_free = min(self.low_free, len(self._free))

    def release_windows(self, block_ids: Sequence[int]) -> None:
        """Drop a reference from each block's companion. An unheld companion of a cached block waits
        in the free queue (a later prefix hit may end at its block); of any other, it goes first."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.window_refs <= 0 or block.companion is None:
                raise RuntimeError(f"block {bid}'s companion released more often than held")
            block.window_refs -= 1
            if block.window_refs:
                continue
            pages = block.companion
            for p in pages:
                self.blocks[p].ref_count = 0
                self._free[p] = None
            if block.block_hash is None:
                self._unlink(bid)
                for p in pages:
                    self._free.move_to_end(p, last=False)

    def cost(self, cached: Sequence[int], held: Sequence[int]) -> int:
        """Pages taking `cached` blocks and holding the companions of `held` (some of them) takes out
        of the free queue."""
        n = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return n + self.groups * sum(1 for b in held if self.blocks[b].window_refs == 0)

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
            if block.ref_count == 1 and block.window_refs:
                raise RuntimeError(f"block {bid} freed while its companion is held")
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
