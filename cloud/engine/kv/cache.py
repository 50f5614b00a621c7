"""The paged KV cache in full precision: per layer, keys and values for every slot of every block.

Layout [kv_heads, num_blocks * block_size, head_dim]: viewed as [kv_heads, num_blocks, block_size,
head_dim], one request's blocks gather into a contiguous [kv_heads, ctx, head_dim] with a single
index_select, the shape attention wants.
Slot s lives in block s // block_size at offset s % block_size. Only the model runner writes here;
the block pool decides which slots belong to whom. `QuantizedKVCache` (quantized_kv_cache.py) has
the same interface; this one is its reference.

With a page layout (kv/layout.py: a model with sliding-window layers), a block is a page of the
global layers only; layers share storage slots, and a local layer reaches its block's page through
the page map [blocks, groups] the block pool keeps: `write` and `gather` translate, so attention
backends keep passing the request's block table. Key summaries (sparse attention's) are kept for
the global layers only.
"""

from __future__ import annotations

import torch

from cloud.engine.kv.key_summary import KeySummaries, StepSlots
from cloud.engine.kv.layout import PageLayout


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        track_summaries: bool = False,
        device: torch.device | str = "cpu",
        layout: PageLayout | None = None,
        page_map: torch.Tensor | None = None,
        summary_parts: int = 1,
    ) -> None:
        """summary_parts: key summaries per block (sparse attention's score_block, key_summary.py)."""
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        slots = num_blocks * block_size
        store = self.storage_dtype(dtype)
        shape = (num_kv_heads, slots, head_dim)
        stored = num_layers if layout is None else layout.num_slots
        ks = [torch.zeros(shape, dtype=store, device=self.device) for _ in range(stored)]
        vs = [torch.zeros(shape, dtype=store, device=self.device) for _ in range(stored)]
        where = range(num_layers) if layout is None else layout.slots
        self.k = [ks[s] for s in where]  # a layer's storage (layers of one slot share it)
        self.v = [vs[s] for s in where]
        self.layout = layout
        self.groups = (-1,) * num_layers if layout is None else layout.groups
        self.page_map = None if layout is None else page_map_for(num_blocks, layout, page_map, self.device)
        if block_size % summary_parts:
            raise ValueError(f"{summary_parts} key summaries do not split a {block_size}-token block")
        # key summaries (sparse attention) for the layers that read blocks through the table, by
        # storage slot: with a page layout the global layers only (local ones attend to their window)
        self.summary_slot = list(where)
        self.summaries = (
            KeySummaries(stored, num_blocks, num_kv_heads, head_dim, self.device, summary_parts)
            if track_summaries
            else None
        )
        self.summary_tokens = block_size // summary_parts  # the tokens one key summary covers
        self._step: StepSlots | None = None

    @staticmethod
    def storage_dtype(dtype: torch.dtype) -> torch.dtype:
        """What a slot holds (Fp8KVCache stores codes instead)."""
        return dtype

    def blocks_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of a layer as [kv_heads, num_blocks, block_size, d] views (what kernels read)."""
        if self.groups[layer] >= 0:
            raise RuntimeError(f"layer {layer} keeps its blocks in companion pages: read it through gather")
        h, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        return self.k[layer].view(h, self.num_blocks, bs, d), self.v[layer].view(h, self.num_blocks, bs, d)

    @staticmethod
    def bytes_per_token(
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        block_size: int = 16,
        track_summaries: bool = False,
        summary_parts: int = 1,
    ) -> float:
        size: float = 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        if track_summaries:
            size += KeySummaries.bytes_per_token(
                num_layers, num_kv_heads, head_dim, block_size, summary_parts
            )
        return float(size)

    def begin_step(self, slot_mapping: torch.Tensor, device_slots: torch.Tensor | None = None) -> None:
        """Called once per step before the layers write: where the step's tokens go (only the key
        summaries need it). device_slots: the same slots on the cache's device, as `write` gets them."""
        if self.summaries is not None:
            slots = slot_mapping if device_slots is None else device_slots
            self._step = StepSlots.of(slots, self.summary_tokens)

    def _slots(self, slot_mapping: torch.Tensor) -> StepSlots:
        step = self._step
        if step is None or step.slots is not slot_mapping:
            step = self._step = StepSlots.of(slot_mapping, self.summary_tokens)
        return step

    def pages(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """Where a layer keeps the blocks of a table: the blocks themselves, or a local layer's
        companion pages."""
        g = self.groups[layer]
        if g < 0 or self.page_map is None:
            return blocks
        return self.page_map[blocks, g]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # k, v: [tokens, kv_heads, head_dim]; slot_mapping: [tokens] int64
        local = self.groups[layer] >= 0
        if local:
            bs = self.block_size
            slot_mapping = self.pages(layer, slot_mapping // bs) * bs + slot_mapping % bs
        self.k[layer].index_copy_(1, slot_mapping, self.encode(layer, k, 0).transpose(0, 1))
        self.v[layer].index_copy_(1, slot_mapping, self.encode(layer, v, 1).transpose(0, 1))
        if self.summaries is not None and not local:
            self.summaries.update(self.summary_slot[layer], k, self._slots(slot_mapping))

    def encode(self, layer: int, x: torch.Tensor, which: int) -> torch.Tensor:
        """x: [tokens, kv_heads, d] as stored (which: 0 keys, 1 values); the identity here."""
        return x

    def decode(self, layer: int, x: torch.Tensor, which: int, head_axis: int) -> torch.Tensor:
        """Stored slots back to the run dtype (x's KV heads on `head_axis`); the identity here."""
        return x

    def block_parts(self) -> list[torch.Tensor]:
        """Every tensor that holds per-block state, each indexed by block id on axis 1: what a block
        is, for a tier that moves it out of the cache and back (kv/tiers/records.py)."""
        if self.layout is not None:
            raise RuntimeError(
                "a block of the per-layer-type layout is not one record (KV tiers need the plain one)"
            )
        parts = [t for layer in range(len(self.k)) for t in self.blocks_view(layer)]
        if self.summaries is not None:
            parts += self.summaries.kmin + self.summaries.kmax
        return parts

    def blocks_loaded(self, block_ids: list[int]) -> None:
        """Blocks were written whole from a tier (nothing to do here: a slot holds all it needs)."""

    def key_bounds(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block key min and max: [kv_heads, num_blocks, d] fp16 each, or [kv_heads, num_blocks,
        parts, d] with several summaries per block."""
        if self.summaries is None:
            raise RuntimeError("this KV cache keeps no key summaries (sparse attention turns them on)")
        if self.groups[layer] >= 0:
            raise RuntimeError(f"layer {layer} attends to its window: it keeps no key summaries")
        slot = self.summary_slot[layer]
        return self.summaries.kmin[slot], self.summaries.kmax[slot]

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks, in table order. blocks: [nb] -> k, v of [kv_heads, nb * block_size, dim];
        [batch, nb] -> [batch, kv_heads, nb * block_size, dim]. Gathering blocks rather than slots
        moves contiguous runs of block_size rows per index."""
        k_all, v_all = self.k[layer], self.v[layer]
        h, _, d = k_all.shape
        bs = self.block_size
        blocks = self.pages(layer, blocks)
        if blocks.dim() == 1 and _consecutive(blocks):
            # blocks allocated in one go from a fresh pool lie side by side: a view, no copy
            lo, hi = int(blocks[0]) * bs, (int(blocks[-1]) + 1) * bs
            return self.decode(layer, k_all[:, lo:hi], 0, 0), self.decode(layer, v_all[:, lo:hi], 1, 0)
        flat = blocks.reshape(-1)
        k = k_all.view(h, self.num_blocks, bs, d).index_select(1, flat)  # [h, nb_total, bs, d]
        v = v_all.view(h, self.num_blocks, bs, d).index_select(1, flat)
        k, v = self.decode(layer, k, 0, 0), self.decode(layer, v, 1, 0)
        return as_context(k, blocks), as_context(v, blocks)

    def gather_per_head(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each KV head its own blocks. blocks: [kv_heads, n] -> [kv_heads, n * bs, d];
        [batch, kv_heads, n] -> [batch, kv_heads, n * bs, d]."""
        h, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        blocks = self.pages(layer, blocks)
        heads = head_index(blocks)
        k = self.k[layer].view(h, self.num_blocks, bs, d)[heads, blocks]  # [..., h, n, bs, d]
        v = self.v[layer].view(h, self.num_blocks, bs, d)[heads, blocks]
        k, v = self.decode(layer, k, 0, -4), self.decode(layer, v, 1, -4)
        return k.flatten(-3, -2), v.flatten(-3, -2)


def page_map_for(
    num_blocks: int, layout: PageLayout, host: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """The page map on the cache's device: the block pool's own tensor where it lives there, else a
    copy (rows past the pool's, spare blocks, map to themselves)."""
    if host is not None and host.device == device and host.shape[0] == num_blocks:
        return host
    rows = torch.arange(num_blocks, dtype=torch.long).view(-1, 1).repeat(1, layout.num_groups)
    if host is not None:
        rows[: host.shape[0]] = host
    return rows.to(device)


def as_context(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Gathered blocks [h, n_total, bs, d] to the context attention reads: [h, n * bs, d] for a table
    blocks [n], [b, h, n * bs, d] for tables [b, n]."""
    h, _, bs, d = x.shape
    if blocks.dim() == 1:
        return x.view(h, -1, d)
    b, nb = blocks.shape
    return x.view(h, b, nb * bs, d).transpose(0, 1)


def head_index(blocks: torch.Tensor) -> torch.Tensor:
    """For per-head block indices [..., kv_heads, n]: the matching head numbers, broadcastable."""
    return torch.arange(blocks.shape[-2], device=blocks.device).view(-1, 1)


def _consecutive(blocks: torch.Tensor) -> bool:
    n = blocks.numel()
    return n > 0 and int(blocks[-1]) - int(blocks[0]) == n - 1 and bool((blocks.diff() == 1).all())
