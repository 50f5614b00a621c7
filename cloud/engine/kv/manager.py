"""Maps requests to blocks: finds a request's cached prefix, allocates the blocks a step needs,
registers newly full blocks in the prefix cache, and frees a request's blocks.

The block pool owns the blocks; this owns each request's `block_ids` and `block_hashes`.
"""

from __future__ import annotations

from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.request import Request
from shared.block_hash import hash_block


class KVManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

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
        return hits

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] | None = None) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after taking `cached` prefix blocks).
        Returns False, changing nothing, when the pool cannot hold them."""
        cached = cached or []
        have = len(req.block_ids) + len(cached)
        total = (
            req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens + self.block_size - 1
        ) // self.block_size
        need = max(0, total - have)
        revived = sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)
        if need + revived > self.pool.num_free:
            return False
        self.pool.touch(cached)
        fresh = self.pool.allocate(need)
        if fresh is None:  # cannot happen after the check above; keep the pool consistent anyway
            self.pool.free(cached)
            return False
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

    def free(self, req: Request) -> None:
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
