"""The host-RAM tier: blocks evicted from the device pool, by block hash, least recently used first
out, bounded in bytes (`--kv-host-memory`). A block lives in one of the pool and this tier: a hit
takes it back out (promotion), an eviction from the pool puts it in (demotion).

On a CPU the device pool is host RAM too; this tier still earns its place there as a second budget
for blocks that no running request holds (a larger pool would serve the same, at the cost of a
larger block table to search). On a GPU it is the step down from HBM.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from shared.block_hash import BlockHash


class HostTier:
    def __init__(self, capacity_bytes: int, record_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.record_bytes = record_bytes
        self._blocks: OrderedDict[BlockHash, torch.Tensor] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    @property
    def used_bytes(self) -> int:
        return len(self._blocks) * self.record_bytes

    @property
    def max_blocks(self) -> int:
        return self.capacity_bytes // self.record_bytes

    def put(self, block_hash: BlockHash, record: torch.Tensor) -> list[tuple[BlockHash, torch.Tensor]]:
        """Keep a block's record (the newest); returns what left to make room, oldest first."""
        if self.max_blocks < 1:
            return [(block_hash, record)]
        self._blocks[block_hash] = record
        self._blocks.move_to_end(block_hash)
        out = []
        while len(self._blocks) > self.max_blocks:
            out.append(self._blocks.popitem(last=False))
        return out

    def clear(self) -> None:
        self._blocks.clear()

    def take(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block's record, which leaves this tier (it goes back to the device pool)."""
        return self._blocks.pop(block_hash, None)
