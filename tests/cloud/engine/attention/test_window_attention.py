"""A sliding-window layer over the paged cache equals attention with the window's mask spelled out
(a query at p sees keys in (p - window, p]), for decode rows of different lengths and for prefill
chunks that start before, at and past the window; global layers go to the wrapped backend; modes
that would ignore a window are refused when the engine starts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cloud.engine.attention import window as window_attention
from cloud.engine.attention.cpu import CpuKernelAttention
from cloud.engine.attention.dense import AttentionMetadata, DenseAttention, PrefillSeq
from cloud.engine.attention.sparse import SparseAttention
from cloud.engine.attention.window import WindowedAttention, with_windows
from cloud.engine.config import SparseConfig
from cloud.engine.kv.cache import KVCache
from shared.errors import ModelLoadError

BS, HEADS, KV_HEADS, DIM, WINDOW = 4, 4, 2, 16, 6
LENGTHS = (3, 6, 7, 13)  # shorter than, equal to, just past and well past the window


def _naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """q: [n, heads, d] at positions qpos; k, v: [ctx, kv_heads, d] at positions 0 .. ctx - 1."""
    kpos = torch.arange(k.shape[0])
    mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - WINDOW)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    )
    return o.transpose(0, 1)


def _table(i: int, n: int) -> torch.Tensor:
    """Request i's blocks, interleaved with the others' so that tables are not ranges."""
    return torch.arange(-(-n // BS)) * len(LENGTHS) + i


def _slots(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return table[positions // BS] * BS + positions % BS


def test_decode_rows_and_prefill_chunks_see_exactly_their_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(window_attention, "_QUERY_TILE", 4)  # the 9-query chunk in tiles of 4, 4, 1
    g = torch.Generator().manual_seed(0)
    cache = KVCache(2, 64, BS, KV_HEADS, DIM, torch.float32)
    dense = DenseAttention(HEADS, KV_HEADS, DIM)
    attn = WindowedAttention(dense, dense, (None, WINDOW))
    ks = [torch.randn(n, KV_HEADS, DIM, generator=g) for n in LENGTHS]
    vs = [torch.randn(n, KV_HEADS, DIM, generator=g) for n in LENGTHS]
    tables = [_table(i, n) for i, n in enumerate(LENGTHS)]
    # all but each request's last token already cached; its last is this step's decode row
    for k, v, t in zip(ks, vs, tables, strict=True):
        cache.write(1, k[:-1], v[:-1], _slots(t, torch.arange(k.shape[0] - 1)))
    q = torch.randn(len(LENGTHS), HEADS, DIM, generator=g)
    k_new = torch.stack([k[-1] for k in ks])
    v_new = torch.stack([v[-1] for v in vs])
    width = max(len(t) for t in tables)
    blocks = torch.stack([F.pad(t, (0, width - len(t))) for t in tables])
    lens = torch.tensor(LENGTHS)
    slots = torch.stack([_slots(t, torch.tensor(n - 1)) for t, n in zip(tables, LENGTHS, strict=True)])
    meta = AttentionMetadata(slots, len(LENGTHS), blocks, None, [], lens)
    cache.write(1, k_new, v_new, slots)
    got = attn(1, q, k_new, v_new, cache, meta)
    for i, n in enumerate(LENGTHS):
        want = _naive(q[i : i + 1], ks[i], vs[i], torch.tensor([n - 1]))
        torch.testing.assert_close(got[i : i + 1], want)

    # the longest request's last 9 tokens again as a prefill chunk after 4 cached ones: its first
    # queries reach back into the cache, its last ones see only the chunk
    n, start = LENGTHS[-1], 4
    qc = torch.randn(n - start, HEADS, DIM, generator=g)
    seq = PrefillSeq(0, n - start, start, tables[-1])
    meta = AttentionMetadata(_slots(tables[-1], torch.arange(start, n)), 0, None, None, [seq])
    got = attn(1, qc, ks[-1][start:], vs[-1][start:], cache, meta)
    torch.testing.assert_close(got, _naive(qc, ks[-1], vs[-1], torch.arange(start, n)))

    # layer 0 is global: the wrapped backend's answer, whole context
    cache.write(0, ks[-1], vs[-1], _slots(tables[-1], torch.arange(n)))
    got = attn(0, qc, ks[-1][start:], vs[-1][start:], cache, meta)
    torch.testing.assert_close(got, dense(0, qc, ks[-1][start:], vs[-1][start:], cache, meta))


def test_modes_that_would_ignore_a_window_are_refused_and_kernels_without_the_head_size_give_way() -> None:
    dense = DenseAttention(HEADS, KV_HEADS, 256)
    windows = (WINDOW, None)
    assert with_windows(dense, (None, None), 256, 0) is dense
    with pytest.raises(ModelLoadError, match="--context-overflow sliding_window"):
        with_windows(dense, windows, 256, sink_blocks=2)
    sparse = SparseAttention(dense, SparseConfig(), 16)  # its selection runs the global layers only
    wrapped = with_windows(CpuKernelAttention(sparse), windows, 256, 0)
    assert isinstance(wrapped, WindowedAttention) and wrapped.inner is sparse and wrapped.dense is dense
    wrapped = with_windows(CpuKernelAttention(dense), windows, 256, 0)
    assert isinstance(wrapped, WindowedAttention) and wrapped.inner is dense  # no 256-wide kernels
    kernels = CpuKernelAttention(DenseAttention(HEADS, KV_HEADS, 128))
    wrapped = with_windows(kernels, windows, 128, 0)
    assert isinstance(wrapped, WindowedAttention) and wrapped.inner is kernels
