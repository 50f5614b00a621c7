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
    block_table: torch.Tensor  # [blocks] the blocks holding positions 0 .. start_pos + q_len - 1


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V is written
    num_decode: int
    decode_blocks: torch.Tensor | None  # [num_decode, max_blocks] block tables (padded with block 0)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool: real positions
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
        if meta.decode_blocks is None:
            raise ValueError("decode rows without block tables in the attention metadata")
        k, v = cache.gather(layer, meta.decode_blocks)  # [b, kv_heads, blocks * block_size, d]
        # One query per request, no causality inside the context: fold each KV head's query group
        # into the query-length axis so K/V are never repeated. qg: [b, kv_heads, group, d]
        qg = q.view(b, self.num_kv_heads, self.group, d)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask, scale=self.scale)
        return o.reshape(b, h, d)

    def _prefill(self, layer: int, q: torch.Tensor, cache: KVCache, seq: PrefillSeq) -> torch.Tensor:
        n, start = q.shape[0], seq.start_pos
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if start == 0:
            k, v = self._context(cache, layer, seq.block_table, 0, n)
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        elif q.device.type == "cpu":
            o = self._prefill_after_prefix(layer, qh, cache, seq)
        else:
            k, v = self._context(cache, layer, seq.block_table, 0, start + n)
            # query i (position start+i) sees keys 0..start+i
            mask = torch.arange(start + n, device=q.device)[None, :] <= (
                torch.arange(n, device=q.device)[:, None] + start
            )
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    def _context(
        self, cache: KVCache, layer: int, table: torch.Tensor, begin: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions begin..end-1: [1, kv_heads, end - begin, d]."""
        bs = cache.block_size
        k, v = cache.gather(layer, table[begin // bs : -(-end // bs)])
        offset = begin % bs
        return k[None, :, offset : offset + end - begin], v[None, :, offset : offset + end - begin]

    def _prefill_after_prefix(
        self, layer: int, q: torch.Tensor, cache: KVCache, seq: PrefillSeq
    ) -> torch.Tensor:
        """A chunk after `start` cached tokens, as two flash calls merged by their log-sum-exps: the
        whole cached prefix without a mask, then the chunk itself causally. A masked call over the
        whole context would compute every masked-out block too (a third more work at 8K in 2K chunks).

        The CPU flash op has no GQA. Against the prefix (no mask) each KV head's query group folds
        into the query axis, so the long prefix is never repeated per query head; only the chunk's
        own keys are (a short question after an 8K cached document copies 30 tokens, not 8K). The
        prefix is gathered on its own, so when its blocks lie side by side it is a view, not a copy."""
        # q: [1, heads, n, d]
        _, h, n, d = q.shape
        start = seq.start_pos
        kvh, g = self.num_kv_heads, self.group
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        kp, vp = self._context(cache, layer, seq.block_table, 0, start)
        folded = q.reshape(1, kvh, g * n, d)  # head kvh*g + j -> kv head kvh (as repeat_interleave)
        o1, lse1 = flash(folded, kp, vp, 0.0, False, scale=self.scale)
        o1, lse1 = o1.reshape(1, h, n, d), lse1.reshape(1, h, n)
        kc, vc = self._context(cache, layer, seq.block_table, start, start + n)
        o2, lse2 = flash(
            q, kc.repeat_interleave(g, dim=1), vc.repeat_interleave(g, dim=1), 0.0, True, scale=self.scale
        )
        m = torch.maximum(lse1, lse2)  # [1, heads, n]
        w1, w2 = torch.exp(lse1 - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)
        return (o1 * w1 + o2 * w2) / (w1 + w2)
