"""Per-block key summaries: for every block, KV head and channel, the min and max of the block's
keys (fp16). Sparse attention bounds q.k over a block from them (Quest); a quantized cache also uses
them as its key zero points and scales, so they cost a quantized cache nothing extra.

They are taken from the keys as written, before any quantization, and kept right as blocks fill
and are reused: a block whose first slot is written this step starts over from +inf / -inf.

With `parts` > 1 (sparse attention's `score_block`, full-precision caches only) each block keeps a
summary per run of block_size / parts tokens, [kv_heads, num_blocks, parts, d]: still indexed by
block id on axis 1, so a tier or a block copy moves them with their block. Each part starts over
when its own first slot is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class StepSlots:
    """Where a step's new tokens go, by block; computed once per step, used by every layer."""

    slots: torch.Tensor  # [tokens] int64
    blocks: torch.Tensor  # [tokens] int64: slot // block_size
    offsets: torch.Tensor  # [tokens] int64: slot % block_size
    restarted: torch.Tensor  # [r] int64: blocks whose first slot is written this step

    @classmethod
    def of(cls, slots: torch.Tensor, block_size: int) -> StepSlots:
        blocks = torch.div(slots, block_size, rounding_mode="floor")
        offsets = slots - blocks * block_size
        return cls(slots, blocks, offsets, blocks[offsets == 0])


class KeySummaries:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        parts: int = 1,
    ) -> None:
        if parts < 1:
            raise ValueError(f"a block's summaries come in at least one part, not {parts}")
        self.parts = parts
        self.block_bytes = KeySummaries.bytes_per_block(num_layers, num_kv_heads, head_dim, parts)
        shape = (
            (num_kv_heads, num_blocks, head_dim)
            if parts == 1
            else (num_kv_heads, num_blocks, parts, head_dim)
        )
        f16 = torch.float16
        self.kmin = [torch.full(shape, torch.inf, dtype=f16, device=device) for _ in range(num_layers)]
        self.kmax = [torch.full(shape, -torch.inf, dtype=f16, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, parts: int = 1) -> int:
        return 2 * 2 * num_layers * num_kv_heads * head_dim * parts  # fp16 min and max per channel

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, parts: int = 1
    ) -> float:
        return KeySummaries.bytes_per_block(num_layers, num_kv_heads, head_dim, parts) / block_size

    def update(self, layer: int, k: torch.Tensor, step: StepSlots) -> None:
        """k: [tokens, kv_heads, d], the step's new keys in slot order; `step` in units of one summary
        (block_size / parts tokens)."""
        kmin, kmax = self.kmin[layer], self.kmax[layer]
        if self.parts > 1:  # the parts in slot order: part p of block b is summary b * parts + p
            kmin, kmax = kmin.flatten(1, 2), kmax.flatten(1, 2)
        if step.restarted.numel():
            kmin[:, step.restarted] = torch.inf
            kmax[:, step.restarted] = -torch.inf
        kt = k.transpose(0, 1).half()  # [h, tokens, d]
        index = step.blocks.view(1, -1, 1).expand_as(kt)
        kmin.scatter_reduce_(1, index, kt, "amin")
        kmax.scatter_reduce_(1, index, kt, "amax")
