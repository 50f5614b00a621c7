"""Per-layer sliding windows (Gemma 3's local layers): a query at position p sees the keys at
positions (p - window, p], as transformers' sliding-window mask and llama.cpp's SWA mask have it.

`WindowedAttention` wraps the backend the engine chose and hands it the global layers; the windowed
layers run here, in PyTorch over the paged cache: a decode row gathers only the blocks its window
touches (a fixed width per row, so a step has no host sync and a CUDA graph can hold it), a prefill
chunk attends to the window's cached keys before it and to its own keys under a banded causal mask.

A local layer reads its blocks through the cache, which maps a block to the layer's own page where
the per-layer-type layout keeps only the window's (kv/layout.py): blocks that left every window are
never read here, so their local pages may be gone (a decode row's gather may reach a block or so
before its window; those keys are masked).

Backends that cannot honour a window are not handed a windowed layer: the compiled kernels (whose
head dims are 64 and 128; Gemma's are 256) give way to the PyTorch reference. Sparse attention
(Quest's block selection) runs the global layers only, where a whole context is read; a local layer
reads its window as under dense. What would have to ignore the window (the StreamingLLM overflow
policy that rotates sink keys with one RoPE) is refused when the engine starts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cloud.engine.attention.dense import (
    AnyKVCache,
    AttentionBackend,
    AttentionMetadata,
    DenseAttention,
    PrefillSeq,
    context,
)
from cloud.engine.attention.kernel import KernelAttention
from cloud.engine.attention.sparse import SparseAttention
from kernels.cpu.paged_attention import HEAD_DIMS as KERNEL_HEAD_DIMS
from shared.errors import ModelLoadError

_QUERY_TILE = 1024  # prefill queries per masked attention call


class WindowedAttention:
    def __init__(self, inner: AttentionBackend, dense: DenseAttention, windows: Sequence[int | None]) -> None:
        self.inner = inner  # the global layers'
        self.dense = dense
        self.windows = tuple(windows)

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: AnyKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        window = self.windows[layer]
        if window is None:
            return self.inner(layer, q, k, v, cache, meta)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            if meta.decode_blocks is None or meta.decode_lens is None:
                raise ValueError("decode rows without block tables or lengths in the attention metadata")
            out[:nd] = self.decode(layer, q[:nd], cache, meta.decode_blocks, meta.decode_lens, window)
        for seq in meta.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            out[rows] = self.prefill(layer, q[rows], k[rows], v[rows], cache, seq, window)
        return out

    def decode(
        self,
        layer: int,
        q: torch.Tensor,
        cache: AnyKVCache,
        tables: torch.Tensor,
        lens: torch.Tensor,
        window: int,
    ) -> torch.Tensor:
        """q: [b, heads, d]; tables: [b, nb]; lens: [b] context lengths, the new token included."""
        b, h, d = q.shape
        bs = cache.block_size
        nb = tables.shape[1]
        # the window spans at most ceil(window / bs) + 1 blocks; each row gathers that many from its
        # first windowed block on (clamped into the table: extra blocks are masked out below)
        width = min(nb, -(-window // bs) + 1)
        first = ((lens - window).clamp(min=0) // bs).clamp(max=nb - width)  # [b]
        cols = first[:, None] + torch.arange(width, device=tables.device)  # [b, width]
        k, v = cache.gather(layer, tables.gather(1, cols))  # [b, kv_heads, width * bs, d]
        pos = (cols[:, :, None] * bs + torch.arange(bs, device=tables.device)).reshape(b, width * bs)
        last = lens[:, None]  # one past the query's position
        mask = ((pos < last) & (pos >= last - window))[:, None, None, :]  # [b, 1, 1, width * bs]
        qg = q.view(b, self.dense.num_kv_heads, self.dense.group, d)  # each KV head's query group
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.dense.scale)
        return o.reshape(b, h, d)

    def prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: AnyKVCache,
        seq: PrefillSeq,
        window: int,
    ) -> torch.Tensor:
        """q: [n, heads, d]; k, v: [n, kv_heads, d], the chunk's own (unrounded by a quantized
        cache, as the reference keeps them) -> [n, heads, d]."""
        n, start = q.shape[0], seq.start_pos
        begin = max(0, start - window + 1)  # the earliest key the chunk's first query sees
        kc, vc = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, n, d]
        if begin < start:
            kp, vp = context(cache, layer, seq.block_table, begin, start)
            kc, vc = torch.cat([kp.to(kc.dtype), kc], dim=2), torch.cat([vp.to(vc.dtype), vc], dim=2)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        out = torch.empty_like(qh)
        # queries in tiles, each against the keys its band reaches: a masked call's scores stay
        # [heads, tile, tile + window] however long the chunk (8K queries at once: 8K x 8.7K a head)
        for lo in range(0, n, _QUERY_TILE):
            hi = min(n, lo + _QUERY_TILE)
            first = max(begin, start + lo - window + 1)  # the tile's earliest visible key
            qpos = torch.arange(start + lo, start + hi, device=q.device)[:, None]
            kpos = torch.arange(first, start + hi, device=q.device)[None, :]
            mask = (kpos <= qpos) & (kpos > qpos - window)  # [tile, keys]
            keys = slice(first - begin, start + hi - begin)
            out[:, :, lo:hi] = F.scaled_dot_product_attention(
                qh[:, :, lo:hi],
                kc[:, :, keys],
                vc[:, :, keys],
                attn_mask=mask,
                scale=self.dense.scale,
                enable_gqa=True,
            )
        return out[0].transpose(0, 1)


def with_windows(
    attention: AttentionBackend, windows: Sequence[int | None], head_dim: int, sink_blocks: int
) -> AttentionBackend:
    """The engine's backend, made to honour the model's per-layer windows (unchanged without any);
    raises ModelLoadError where a chosen mode cannot honour them."""
    if all(w is None for w in windows):
        return attention
    if sink_blocks:
        raise ModelLoadError(
            "--context-overflow sliding_window cannot run a model with sliding-window layers (their "
            "sink keys would need each layer's own RoPE); use --context-overflow error or truncate_middle"
        )
    reference = attention.reference if isinstance(attention, KernelAttention) else attention
    # sparse attention selects blocks in the global layers; the local ones attend to their window
    dense = reference.dense if isinstance(reference, SparseAttention) else reference
    if not isinstance(dense, DenseAttention):
        raise ModelLoadError(f"{type(reference).__name__} cannot honour this model's sliding-window layers")
    inner = attention
    if isinstance(attention, KernelAttention) and head_dim not in KERNEL_HEAD_DIMS:
        inner = reference  # the compiled kernels (C++ and Triton alike) have no such head size
    return WindowedAttention(inner, dense, windows)
