"""The paged KV cache tensors: per layer, keys and values for every slot of every block.

Layout [kv_heads, num_blocks * block_size, head_dim]: viewed as [kv_heads, num_blocks, block_size,
head_dim], one request's blocks gather into a contiguous [kv_heads, ctx, head_dim] with a single
index_select, the shape attention wants.
Slot s lives in block s // block_size at offset s % block_size. Only the model runner writes here;
the block pool decides which slots belong to whom.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        slots = num_blocks * block_size
        self.k = [torch.zeros(num_kv_heads, slots, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(num_kv_heads, slots, head_dim, dtype=dtype) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # k, v: [tokens, kv_heads, head_dim]; slot_mapping: [tokens] int64
        self.k[layer].index_copy_(1, slot_mapping, k.transpose(0, 1))
        self.v[layer].index_copy_(1, slot_mapping, v.transpose(0, 1))

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole blocks, in table order. blocks: [nb] -> k, v of [kv_heads, nb * block_size, dim];
        [batch, nb] -> [batch, kv_heads, nb * block_size, dim]. Gathering blocks rather than slots
        moves contiguous runs of block_size rows per index."""
        k_all, v_all = self.k[layer], self.v[layer]
        h, _, d = k_all.shape
        bs = self.block_size
        if blocks.dim() == 1 and _consecutive(blocks):
            # blocks allocated in one go from a fresh pool lie side by side: a view, no copy
            lo, hi = int(blocks[0]) * bs, (int(blocks[-1]) + 1) * bs
            return k_all[:, lo:hi], v_all[:, lo:hi]
        flat = blocks.reshape(-1)
        k = k_all.view(h, self.num_blocks, bs, d).index_select(1, flat)  # [h, nb_total, bs, d]
        v = v_all.view(h, self.num_blocks, bs, d).index_select(1, flat)
        if blocks.dim() == 1:
            return k.view(h, -1, d), v.view(h, -1, d)
        b, nb = blocks.shape
        k = k.view(h, b, nb * bs, d).transpose(0, 1)
        v = v.view(h, b, nb * bs, d).transpose(0, 1)
        return k, v


def _consecutive(blocks: torch.Tensor) -> bool:
    n = blocks.numel()
    return n > 0 and int(blocks[-1]) - int(blocks[0]) == n - 1 and bool((blocks.diff() == 1).all())
