"""Attention backends. One interface: given the step's queries, its fresh keys and values (already
written to the cache), the KV cache and each request's context, return outputs. `DenseAttention`
is the reference; `SparseAttention` (sparse_attention.py) sits behind the same interface.

A step's tokens are laid out decode-first: the first `num_decode` rows are single-token decode
queries (batched into one padded SDPA call), the rest are prefill chunks (one call or two each).
A prefill chunk attends to its own keys from the fresh tensors, not from the cache, so a quantized
cache never rounds the keys of the tokens being computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.quantized_cache import QuantizedKVCache
from cloud.model.rope import RotaryEmbedding

AnyKVCache = KVCache | QuantizedKVCache


@dataclass(slots=True)
class PrefillSeq:
    """One request's prefill chunk within the step."""

    q_start: int  # first row of this chunk in the step's token layout
    q_len: int
    start_pos: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [blocks] the blocks holding positions 0 .. start_pos + q_len - 1
    sink_shift: int = 0  # sliding window: tokens dropped between the sinks and the window


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] where each new token's K/V is written
    num_decode: int
    decode_blocks: torch.Tensor | None  # [num_decode, max_blocks] block tables (padded with block 0)
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] bool: real positions
    prefills: list[PrefillSeq]
    decode_lens: torch.Tensor | None = None  # [num_decode] context length, the new token included
    decode_shift: torch.Tensor | None = None  # [num_decode] sliding window: tokens dropped (0: none)
    sink_tokens: int = 0  # sliding window: the leading tokens kept as attention sinks
    max_decode_len: int = 0  # the longest decode context (host-side: kernels size their grids by it)
    # all prefill chunks at once, for a varlen kernel: [s + 1] row offsets, [s] cached tokens before
    # each, [s, blocks] tables, and the longest chunk (host-side)
    prefill_cu_q: torch.Tensor | None = None
    prefill_start: torch.Tensor | None = None
    prefill_tables: torch.Tensor | None = None
    max_prefill_len: int = 0


class AttentionBackend(Protocol):
    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: AnyKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [tokens, heads, d]; k, v: [tokens, kv_heads, d] (this step's) -> [tokens, heads, d]."""
        ...


@dataclass(slots=True)
class BoundAttention:
    """A backend bound to the cache and one step's metadata: the model's `StepAttention`. Each
    layer's fresh keys and values are stored first, so decode rows read them from the cache."""

    backend: AttentionBackend
    cache: AnyKVCache
    meta: AttentionMetadata

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, k, v, self.meta.slot_mapping)
        return self.backend(layer, q, k, v, self.cache, self.meta)


def attend_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [1, h, n, d], k / v: [1, h, s, d] (same head count) -> out [1, h, n, d], lse [1, h, n].
    Causal is top-left aligned (query i sees keys 0..i). On CPU the flash kernel returns the LSE."""
    if q.device.type == "cpu":
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o, lse = flash(q, k, v, 0.0, causal, scale=scale)
        return o, lse
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [1, h, n, s]
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), -torch.inf)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()).to(q.dtype)
    return o, lse


def merge_by_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Softmax attention over disjoint key sets, combined: parts of (out [.., n, d], lse [.., n])."""
    m = torch.stack([lse for _, lse in parts]).amax(0)
    num = torch.zeros_like(parts[0][0], dtype=torch.float32)
    den = torch.zeros_like(m)
    for o, lse in parts:
        w = torch.exp(lse - m)
        num += o.float() * w.unsqueeze(-1)
        den += w
    return (num / den.unsqueeze(-1)).to(parts[0][0].dtype)


def shift_sinks(
    rope: RotaryEmbedding | None, k: torch.Tensor, shift: torch.Tensor, sink_tokens: int
) -> torch.Tensor:
    """StreamingLLM positions for a sliding-window request: the sink keys are rotated on by the
    number of dropped tokens, so they sit right before the window as in the cache, and every query
    sees them at the distance the model knows (keys are stored rotated; R(a) R(b) = R(a + b)).
    k: [..., kv_heads, ctx, d] with the sinks first; shift: broadcastable to k's leading dims."""
    if rope is None:
        raise ValueError("sliding-window attention needs the model's rotary embedding")
    sinks = rope.shift(k[..., :sink_tokens, :], shift)
    return torch.cat([sinks, k[..., sink_tokens:, :]], dim=-2)


class DenseAttention:
    """Exact softmax attention over each request's whole context (its live blocks, for a sliding
    window)."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, rope: RotaryEmbedding | None = None
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.rope = rope

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: AnyKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        if meta.num_decode:
            if meta.decode_blocks is None:
                raise ValueError("decode rows without block tables in the attention metadata")
            out[: meta.num_decode] = self.decode(
                layer,
                q[: meta.num_decode],
                cache,
                meta.decode_blocks,
                meta.decode_mask,
                meta.decode_shift,
                meta.sink_tokens,
            )
        for seq in meta.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            out[rows] = self.prefill(layer, q[rows], k[rows], v[rows], cache, seq, meta.sink_tokens)
        return out

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        cache: AnyKVCache,
        blocks: torch.Tensor,
        mask: torch.Tensor | None,
        shift: torch.Tensor | None = None,
        sink_tokens: int = 0,
    ) -> torch.Tensor:
        """q: [b, heads, d]; blocks: [b, nb] tables; mask: [b, 1, 1, nb * bs] or None;
        shift: [b] tokens each sliding-window row dropped after its sinks, or None."""
        b, h, d = q.shape
        k, v = cache.gather(layer, blocks)  # [b, kv_heads, blocks * block_size, d]
        if shift is not None and bool(shift.any()):
            k = shift_sinks(self.rope, k, shift.view(b, 1), sink_tokens)
        # One query per request, no causality inside the context: fold each KV head's query group
        # into the query-length axis so K/V are never repeated. qg: [b, kv_heads, group, d]
        qg = q.view(b, self.num_kv_heads, self.group, d)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
        return o.reshape(b, h, d)

    def prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: AnyKVCache,
        seq: PrefillSeq,
        sink_tokens: int = 0,
    ) -> torch.Tensor:
        """q: [n, heads, d]; k, v: [n, kv_heads, d], the chunk's own -> [n, heads, d]."""
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        kc, vc = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, d]
        if seq.start_pos == 0:
            o = F.scaled_dot_product_attention(qh, kc, vc, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            kp, vp = context(cache, layer, seq.block_table, 0, seq.start_pos)
            if seq.sink_shift:
                kp = shift_sinks(self.rope, kp, torch.tensor(seq.sink_shift), sink_tokens)
            o = self.prefix_then_chunk(qh, kp, vp, kc, vc)
        return o[0].transpose(0, 1)

    def prefix_then_chunk(
        self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
    ) -> torch.Tensor:
        """A chunk after cached keys, as two flash calls merged by their log-sum-exps: the prefix
        keys (kp, vp: [1, kv_heads, s, d], all earlier than the chunk) without a mask, then the chunk
        itself (kc, vc: [1, kv_heads, n, d]) causally. A masked call over the whole context would
        compute every masked-out block too (a third more work at 8K in 2K chunks).

        The CPU flash op has no GQA. Against the prefix (no mask) each KV head's query group folds
        into the query axis, so the long prefix is never repeated per query head; only the chunk's
        own keys are (a short question after an 8K cached document copies 30 tokens, not 8K)."""
        # q: [1, heads, n, d]
        _, h, n, d = q.shape
        kvh, g = self.num_kv_heads, self.group
        folded = q.reshape(1, kvh, g * n, d)  # head kvh*g + j -> kv head kvh (as repeat_interleave)
        o1, lse1 = attend_with_lse(folded, kp, vp, False, self.scale)
        o2, lse2 = attend_with_lse(
            q, kc.repeat_interleave(g, dim=1), vc.repeat_interleave(g, dim=1), True, self.scale
        )
        return merge_by_lse([(o1.reshape(1, h, n, d), lse1.reshape(1, h, n)), (o2, lse2)])


def context(
    cache: AnyKVCache, layer: int, table: torch.Tensor, begin: int, end: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions begin..end-1 from the cache: [1, kv_heads, end - begin, d]."""
    bs = cache.block_size
    k, v = cache.gather(layer, table[begin // bs : -(-end // bs)])
    offset = begin % bs
    return k[None, :, offset : offset + end - begin], v[None, :, offset : offset + end - begin]
