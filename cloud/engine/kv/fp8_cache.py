"""A paged KV cache stored as fp8 (e4m3): half the bytes of bf16, a quarter of fp32, with the
layout and interface of KVCache, as vLLM and SGLang offer on GPUs (`--kv-dtype fp8`).

Each layer and KV head has a scale for keys and one for values: stored = x / scale, rounded to the
nearest e4m3 value after clamping to its range (+-448; e4m3fn has no infinity, so an unclamped
overflow would become NaN). The scales default to 1 (vLLM's default when a checkpoint carries
none): e4m3 keeps 3 mantissa bits, a relative error of at most 1/16, over 2^-9 .. 448.

Slots hold the codes as uint8 (index_copy and index_select are not defined for fp8 on every
backend); they are reinterpreted as float8_e4m3fn to decode. The Triton decode kernel reads the same
bytes and scales and dequantizes in registers (kernels/triton/paged_decode.py).
"""

from __future__ import annotations

import torch

from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.layout import PageLayout

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class Fp8KVCache(KVCache):
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
        super().__init__(
            num_layers,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            track_summaries,
            device,
            layout,
            page_map,
            summary_parts,
        )
        # [layers, 2 (keys, values), kv_heads] fp32
        self.scales = torch.ones(num_layers, 2, num_kv_heads, dtype=torch.float32, device=self.device)

    @staticmethod
    def storage_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.uint8

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
        return KVCache.bytes_per_token(
            num_layers, num_kv_heads, head_dim, torch.uint8, block_size, track_summaries, summary_parts
        )

    def encode(self, layer: int, x: torch.Tensor, which: int) -> torch.Tensor:
        # x: [tokens, kv_heads, d] -> uint8 codes of the same shape
        scale = self.scales[layer, which].view(1, -1, 1)
        y = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX)
        return y.to(FP8).view(torch.uint8)

    def decode(self, layer: int, x: torch.Tensor, which: int, head_axis: int) -> torch.Tensor:
        shape = [1] * x.dim()
        shape[head_axis] = self.num_kv_heads
        scale = self.scales[layer, which].view(shape)
        return (x.view(FP8).float() * scale).to(self.dtype)

    def fp8_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the fp8 decode kernel reads: keys and values as [kv_heads, num_blocks, block_size, d]
        float8_e4m3fn views, and their per-head scales [kv_heads] fp32."""
        k, v = self.blocks_view(layer)
        return k.view(FP8), v.view(FP8), self.scales[layer, 0], self.scales[layer, 1]
