"""Attention backends. One interface: given the step's queries, the KV cache and each request's
context slots, return outputs. `DenseAttention` is the reference; the long-context issue adds a
sparse backend behind the same interface.

A step's tokens are laid out decode-first: the first `num_decode` rows are single-token decode
queries (batched into one padded SDPA call), the rest are prefill chunks (one SDPA call each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from .kv_cache import KVCache


@dataclass(slots=True)
class PrefillSeq:
    """One request's prefill chunk within the step."""

    q_start: int  # first row of this chunk in the step's token layout
    q_len: int
    start_pos: int  # tokens already in the cache before this chunk
    slots: torch.Tensor  # [start_pos + q_len] slots of the whole context, in position order
    causal_mask: torch.Tensor | None  # [q_len, ctx] bool (True = attend); None when start_pos == 0


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V is written
    num_decode: int
    decode_slots: torch.Tensor | None  # [num_decode, max_ctx] (padded with slot 0)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_ctx] bool; None when no padding
    prefills: list[PrefillSeq]


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """q: [tokens, heads, head_dim] -> [tokens, heads, head_dim]."""
        ...


class DenseAttention:
    """Exact softmax attention over each request's whole context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5

    def __call__(self, layer: int, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(layer, q[: meta.num_decode], cache, meta)
        for seq in meta.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            out[rows] = self._prefill(layer, q[rows], cache, seq)
        return out

    def _decode(self, layer: int, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        b, h, d = q.shape
        if meta.decode_slots is None:
            raise ValueError("decode rows without decode slots in the attention metadata")
        k, v = cache.gather(layer, meta.decode_slots)  # [b, kv_heads, ctx, d]
        # One query per request, no causality inside the context: fold each KV head's query group
        # into the query-length axis so K/V are never repeated. qg: [b, kv_heads, group, d]
        qg = q.view(b, self.num_kv_heads, self.group, d)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask, scale=self.scale)
        return o.reshape(b, h, d)

    def _prefill(self, layer: int, q: torch.Tensor, cache: KVCache, seq: PrefillSeq) -> torch.Tensor:
        k, v = cache.gather(layer, seq.slots)  # [kv_heads, ctx, d]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        kh, vh = k.unsqueeze(0), v.unsqueeze(0)
        if seq.causal_mask is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=seq.causal_mask, scale=self.scale, enable_gqa=True
            )
        return o[0].transpose(0, 1)
