"""Maps requests to blocks: finds a request's cached prefix, allocates the blocks a step needs,
registers newly full blocks in the prefix cache, and frees a request's blocks.

The block pool owns the blocks; this owns each request's `block_ids` and `block_hashes`. With tiers
below the pool (kv/tiers/offload.py), a prefix lookup goes on through them past the pool's last hit.

With a page layout (kv/layout.py), a request holds the companions (local layers' pages) of its blocks
from `window_from` on: the first block its next query can see. A prefix hit is whole only where the
blocks its next query sees still have theirs, so a lookup ends at the last such block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.kv.layout import PageLayout
from cloud.engine.request import Request
from shared.block_hash import BlockHash, hash_block

if TYPE_CHECKING:
    import torch

    from cloud.engine.kv.tiers.offload import KVTiers


class KVManager:
    def __init__(self, pool: BlockPool, block_size: int, layout: PageLayout | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.tiers: KVTiers | None = None
        self.layout = layout if pool.groups else None

    def _window_start(self, position: int) -> int:
        """The first block whose companion a query at `position` needs (0: all; plain layout: 0)."""
        return 0 if self.layout is None else self.layout.window_start(position, self.block_size)

    def _extend_hashes(self, req: Request) -> list[bytes]:
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), req.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            extra = req.extra_key
            for span in req.image_spans:
                if span.start < (i + 1) * bs and span.end > i * bs:
                    extra += span.digest
            hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs], extra))
        return hashes

    def cached_prefix(self, req: Request) -> list[int]:
        """Leading blocks of the request's tokens found in the prefix cache.

        At least one token is always left to compute (the step that computes it yields the logits
        to sample from), so a prompt that is cached in full gives back its last block.
        """
        if not self.pool.enable_prefix_caching or req.params.prompt_logprobs is not None or req.sliding:
            # prompt logprobs need every prompt position computed; a sliding request would take
            # back its whole history at once (more than its ring holds)
            return []
        hashes = self._extend_hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in hashes[:limit]:
            bid = self.pool.lookup(h)
            if bid is None:
                break
            hits.append(bid)
        if self.tiers is not None and len(hits) < limit:
            hits += self._promote(hashes[len(hits) : limit], hits)
        return self._whole(hits)

    def _whole(self, hits: list[int]) -> list[int]:
        """The longest head of a prefix hit whose next query finds every companion it reads."""
        n = len(hits)
        while self.layout is not None and n:
            lo = self._window_start(n * self.block_size)
            missing = [i for i in range(lo, n) if self.pool.blocks[hits[i]].companion is None]
            if not missing:
                break
            n = missing[-1]
        return hits[:n]

    def prefetch(self, req: Request) -> None:
        """Have the tiers start reading what the request's prefix needs from disk, while it waits."""
        if self.tiers is None or req.params.prompt_logprobs is not None or req.sliding:
            return
        hashes = self._extend_hashes(req)[: (req.num_tokens - 1) // self.block_size]
        hit = 0
        while hit < len(hashes) and self.pool.lookup(hashes[hit]) is not None:
            hit += 1
        self.tiers.prefetch(hashes[hit:])

    def _promote(self, hashes: list[BlockHash], held: list[int]) -> list[int]:
        """The blocks continuing a prefix past the pool's hits (`held`): from the pool where it has
        them, else brought back from a tier into fresh pool blocks, up to the first block found
        nowhere or as many as the pool has free. They come back unreferenced, as cached blocks do."""
        tiers, pool = self.tiers, self.pool
        assert tiers is not None
        pool.touch(held)  # making room must not evict the prefix found so far
        chain: list[int | None] = []  # the continuation: a pool block, or None for the next record
        records: list[tuple[BlockHash, torch.Tensor]] = []
        try:
            for h in hashes:
                bid = pool.lookup(h)
                if bid is not None:
                    pool.touch([bid])
                    chain.append(bid)
                    continue
                if len(records) >= pool.num_free:
                    break
                record = tiers.fetch(h)
                if record is None:
                    break
                records.append((h, record))
                chain.append(None)
            if records:
                fresh = pool.allocate(len(records)) or []  # (demotes what it evicts to make room)
                tiers.promote(fresh, [r for _, r in records])  # bytes copied in at the step's start
                for bid, (h, _) in zip(fresh, records, strict=True):
                    pool.cache(bid, h)
                it = iter(fresh)
                chain = [next(it) if b is None else b for b in chain]
        finally:
            pool.free([b for b in chain if b is not None])  # each referenced once above
            pool.free(held)
        return [b for b in chain if b is not None]

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after taking `cached` prefix blocks).
        Returns False, changing nothing, when the pool cannot hold them."""
        cached = cached or []
        have = len(req.block_ids) + len(cached)
        total = (
            req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens + self.block_size - 1
        ) // self.block_size
        need = max(0, total - have)
        # a request taking a cached prefix holds no blocks yet: it holds the companions of those its
        # next query sees
        hold = cached[self._window_start(len(cached) * self.block_size) :] if cached else []
        if need * (1 + self.pool.groups) + self.pool.cost(cached, hold) > self.pool.num_free:
            return False
        self.pool.touch(cached)
        if self.layout is not None:
            self.pool.hold_windows(hold)
        fresh = self.pool.allocate(need)
        if fresh is None:  # cannot happen after the check above; keep the pool consistent anyway
            if self.layout is not None:
                self.pool.release_windows(hold)
            self.pool.free(cached)
            return False
        if cached:
            req.window_from = len(cached) - len(hold)
        req.block_ids.extend(cached)
        req.block_ids.extend(fresh)
        # Only a cached prefix (taken at admission, by a request holding no blocks) is registered
        # already; a partly filled block is registered by register_full_blocks once it fills up.
        req.num_registered_blocks = max(req.num_registered_blocks, len(cached))
        return True

    def register_full_blocks(self, req: Request) -> None:
        """Enter every fully computed block of the request into the prefix cache."""
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks or not self.pool.enable_prefix_caching:
            return
        hashes = self._extend_hashes(req)
        for i in range(req.num_registered_blocks, full):
            self.pool.cache(req.block_ids[i], hashes[i])
        req.num_registered_blocks = full

    def slide_windows(self, req: Request) -> None:
        """Let go of the companions of blocks the request's next query no longer sees."""
        if self.layout is None:
            return
        end = min(self._window_start(req.num_computed_tokens), len(req.block_ids))
        if end > req.window_from:
            self.pool.release_windows(req.block_ids[req.window_from : end])
            req.window_from = end

    def free(self, req: Request) -> None:
        if self.layout is not None:  # companions first: they go before their blocks
            self.pool.release_windows(req.block_ids[req.window_from :])
            req.window_from = 0
        self.pool.free([b for b in req.block_ids if b >= 0])
        req.block_ids = []
        req.num_registered_blocks = 0

    def slide(self, req: Request, sink_blocks: int, ring_blocks: int) -> None:
        """Keep a sliding request within `ring_blocks` live blocks: free its oldest blocks after the
        sinks (full and registered ones: the newest, partly filled block is never among them)."""
        live = [i for i, b in enumerate(req.block_ids) if b >= 0]
        excess = len(live) - ring_blocks
        for i in live[sink_blocks:][: max(0, excess)]:
            self.pool.free([req.block_ids[i]])
            req.block_ids[i] = -1
