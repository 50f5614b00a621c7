"""Per-block key summaries: for every block, KV head and channel, the min and max of the block's
keys (fp16). Sparse attention bounds q.k over a block from them (Quest); a quantized cache also uses
them as its key zero points and scales, so they cost a quantized cache nothing extra.

They are taken from the keys as written, before any quantization, and kept right as blocks fill
and are reused: a block whose first slot is written this step starts over from +inf / -inf.
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
    ) -> None:
        shape = (num_kv_heads, num_blocks, head_dim)
        f16 = torch.float16
        self.kmin = [torch.full(shape, torch.inf, dtype=f16, device=device) for _ in range(num_layers)]
        self.kmax = [torch.full(shape, -torch.inf, dtype=f16, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int) -> float:
        return 2 * 2 * num_layers * num_kv_heads * head_dim / block_size

    def update(self, layer: int, k: torch.Tensor, step: StepSlots) -> None:
        """k: [tokens, kv_heads, d], the step's new keys in slot order."""
        kmin, kmax = self.kmin[layer], self.kmax[layer]
        if step.restarted.numel():
            kmin[:, step.restarted] = torch.inf
            kmax[:, step.restarted] = -torch.inf
        kt = k.transpose(0, 1).half()  # [h, tokens, d]
        index = step.blocks.view(1, -1, 1).expand_as(kt)
        kmin.scatter_reduce_(1, index, kt, "amin")
        kmax.scatter_reduce_(1, index, kt, "amax")
