"""Paged decode attention: one new query token per request against its whole context, read straight
from the block table (split-KV / flash-decoding, GQA-packed).

For request i, query head h (kv head j = h // G) and its context of n_i = context_lens[i] tokens:

    out[i, h] = softmax(scale * q[i, h] . K_j[:n_i]^T) @ V_j[:n_i]

where token t of the context lives at row t % block_size of block block_tables[i, t // block_size]
of k_cache / v_cache [kv_heads, num_blocks, block_size, d]. Table entries at or past
ceil(n_i / block_size) are padding and never read; a request with n_i = 0 gets 0. An fp8 cache
(float8_e4m3fn) holds x / scale per KV head: each tile is dequantized in registers after its load.

Pass 1, grid (b, kv_heads, S): program (i, j, s) loads the query group of kv head j ([G_PAD, d],
the G query heads padded to a power of two >= 16 so tl.dot works on the GPU) once, then walks
split s of request i's tiles of TILE_TOKENS tokens (the tiles are shared out in contiguous runs,
per request, from its own length, so no host sync is needed), with an online softmax in fp32. It
reads G * d query values, about n_i / S * d * 2 K/V elements (each read once for the whole group)
plus one table entry per token, and writes G * (d + 1) fp32: partial out [b, H, S, d] and log-sum-exp
[b, H, S] (-inf where the split was empty). Pass 2 is `merge_splits` (split_reduce.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .split_reduce import merge_splits, sm_count

TILE_TOKENS = 32  # context tokens per loop iteration (a tile may span blocks or part of a block)
MAX_SPLITS = 64
HEAD_DIMS = (64, 128)
Q_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    q,  # [b, H, d]
    k_cache,  # [kv_heads, num_blocks, block_size, d]
    v_cache,  # [kv_heads, num_blocks, block_size, d]
    block_tables,  # [b, max_blocks] int32 / int64
    context_lens,  # [b] int32 / int64
    k_scale,  # [kv_heads] fp32 (read only when FP8)
    v_scale,  # [kv_heads] fp32 (read only when FP8)
    partial_out,  # [b, H, S, d] fp32
    partial_lse,  # [b, H, S] fp32
    stride_qb,
    stride_qh,
    stride_kh,
    stride_kn,
    stride_kt,
    stride_vh,
    stride_vn,
    stride_vt,
    stride_tb,
    stride_tn,
    stride_cb,
    stride_ks,
    stride_vs,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    qk_scale,  # softmax scale * log2(e): scores in base 2
    max_tokens,  # max_blocks * block_size: a longer context_len is clamped to the table
    num_splits,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    kvh64 = kvh.to(tl.int64)

    g = tl.arange(0, G_PAD)
    dd = tl.arange(0, HEAD_DIM)
    tt = tl.arange(0, TILE_N)
    g_ok = g < GROUP
    heads = kvh * GROUP + g  # query heads of this KV head's group

    # this program's contiguous run of the request's tiles
    n_ctx = tl.load(context_lens + req * stride_cb)
    n_ctx = tl.minimum(tl.maximum(n_ctx, 0), max_tokens)
    n_tiles = tl.cdiv(n_ctx, TILE_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, n_tiles)

    q_ptrs = q + req * stride_qb + heads[:, None] * stride_qh + dd[None, :]
    qg = tl.load(q_ptrs, mask=g_ok[:, None], other=0.0).to(tl.float32)  # [G_PAD, d]
    if FP8:
        ks = tl.load(k_scale + kvh * stride_ks)
        vs = tl.load(v_scale + kvh * stride_vs)
        qk_scale = qk_scale * ks  # real K = stored * ks: fold it into the score scale

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    k_head = k_cache + kvh64 * stride_kh
    v_head = v_cache + kvh64 * stride_vh
    table = block_tables + req.to(tl.int64) * stride_tb
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE_N + tt  # context positions of this tile
        ok = pos < n_ctx
        blk = tl.load(table + (pos // BLOCK_SIZE) * stride_tn, mask=ok, other=0).to(tl.int64)
        row = (pos % BLOCK_SIZE).to(tl.int64)
        k_off = blk[:, None] * stride_kn + row[:, None] * stride_kt + dd[None, :]
        v_off = blk[:, None] * stride_vn + row[:, None] * stride_vt + dd[None, :]
        k = tl.load(k_head + k_off, mask=ok[:, None], other=0.0).to(tl.float32)  # [TILE_N, d]
        v = tl.load(v_head + v_off, mask=ok[:, None], other=0.0).to(tl.float32)  # [TILE_N, d]

        s = tl.dot(qg, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G_PAD, TILE_N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a real token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    if FP8:
        o = o * vs  # real V = stored * vs
    # base-2 max and sum back to a natural-log lse (x ln 2), as merge_splits reads it
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    po = partial_out + req * stride_pb + heads[:, None] * stride_ph + split * stride_ps + dd[None, :]
    tl.store(po, o, mask=g_ok[:, None])
    tl.store(partial_lse + req * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


def default_num_splits(
    batch: int, kv_heads: int, max_blocks: int, block_size: int, device: torch.device
) -> int:
    """Splits per (request, KV head), from shapes only (CUDA-graph safe): on a GPU enough programs
    to give every SM about 4, but no more splits than the longest possible context has tiles, and
    at most MAX_SPLITS; under the CPU interpreter 2, for speed."""
    max_tiles = max(1, -(-max_blocks * block_size // TILE_TOKENS))
    if device.type != "cuda":
        return min(2, max_tiles)
    sms = sm_count(device)
    want = -(-4 * sms // max(1, batch * kv_heads))
    return max(1, min(want, max_tiles, MAX_SPLITS))


def decode_bytes_read(
    total_context_tokens: int, kv_heads: int, head_dim: int, cache_dtype: torch.dtype
) -> int:
    """Bytes of K and V one decode step reads from the cache: each token of each request's context,
    once per KV head (the query group shares the read). total_context_tokens = sum of context_lens.
    Queries, tables, scales and the partial outputs are small beside it and not counted."""
    elem = torch.empty((), dtype=cache_dtype).element_size()
    return 2 * total_context_tokens * kv_heads * head_dim * elem


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            "paged_decode wants q [b, heads, d] and caches [kv_heads, num_blocks, block_size, d], got "
            f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    h, d = q.shape[1:]
    kv_heads, _, block_size, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head dims differ: q has {d}, the cache {dk}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d} is not supported (only {HEAD_DIMS})")
    if kv_heads == 0 or h % kv_heads != 0:
        raise ValueError(f"{h} query heads are not a multiple of {kv_heads} KV heads")
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not one of {Q_DTYPES}")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"cache dtypes {k_cache.dtype} / {v_cache.dtype}: want one of {CACHE_DTYPES}, both alike"
        )
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")


def _check_tables(b: int, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    if block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must be [b={b}, max_blocks]")
    if context_lens.shape != (b,):
        raise ValueError(f"context_lens {tuple(context_lens.shape)} must be [b={b}]")
    if block_tables.dtype not in INDEX_DTYPES or context_lens.dtype not in INDEX_DTYPES:
        raise ValueError("block_tables and context_lens must be int32 or int64")


def _check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if k_cache.dtype != torch.float8_e4m3fn:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale apply to an fp8 cache only, not {k_cache.dtype}")
        return
    kv_heads = k_cache.shape[0]
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is None:
            raise ValueError(f"an fp8 cache needs {name} (fp32 [kv_heads])")
        if sc.shape != (kv_heads,) or sc.dtype != torch.float32:
            raise ValueError(f"{name} must be fp32 [{kv_heads}], got {sc.dtype} {tuple(sc.shape)}")


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    _check_shapes(q, k_cache, v_cache)
    _check_tables(q.shape[0], block_tables, context_lens)
    _check_scales(k_cache, k_scale, v_scale)
    tensors = [t for t in (k_cache, v_cache, block_tables, context_lens, k_scale, v_scale) if t is not None]
    if any(t.device != q.device for t in tensors):
        raise ValueError("all tensors must be on one device")


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention from the paged cache. q: [b, H, d] fp32/fp16/bf16; k_cache, v_cache:
    [kv_heads, num_blocks, block_size, d] (any strides, last dim contiguous) fp32/fp16/bf16 or
    float8_e4m3fn with k_scale, v_scale fp32 [kv_heads]; block_tables [b, max_blocks] and
    context_lens [b] int32/int64 (the new token included; 0 gives 0). Returns [b, H, d] in q.dtype,
    written into `out` when given. No host sync: safe to capture in a CUDA graph."""
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    b, h, d = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must be {q.dtype} {tuple(q.shape)} on {q.device} with a contiguous last dimension"
        )
    if num_splits is None:
        num_splits = default_num_splits(b, kv_heads, max_blocks, block_size, q.device)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if b == 0 or h == 0:
        return out
    group = h // kv_heads
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    # fp32 operands keep full precision; 16-bit and fp8 values are exact in tf32
    exact = q.dtype == torch.float32 or k_cache.dtype == torch.float32
    partial_out = torch.empty(b, h, num_splits, d, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=q.device)
    ks = k_scale if fp8 and k_scale is not None else context_lens  # never read unless FP8
    vs = v_scale if fp8 and v_scale is not None else context_lens
    _paged_decode_kernel[(b, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        ks,
        vs,
        partial_out,
        partial_lse,
        *q.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *block_tables.stride(),
        context_lens.stride(0),
        ks.stride(0),
        vs.stride(0),
        *partial_out.stride()[:3],
        *partial_lse.stride()[:2],
        float(scale) * _LOG2E,
        max_blocks * block_size,
        num_splits,
        GROUP=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        TILE_N=TILE_TOKENS,
        FP8=fp8,
        DOT_PRECISION="ieee" if exact else "tf32",
        num_warps=4,
    )
    return merge_splits(partial_out, partial_lse, out)


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same in PyTorch, one request at a time: gather its blocks, fp32 softmax, cast to q.dtype."""
    b, h, d = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    out = torch.zeros(b, h, d, dtype=torch.float32, device=q.device)
    for i, n in enumerate(context_lens.tolist()):
        if n <= 0:
            continue
        blocks = block_tables[i, : math.ceil(n / block_size)].long()
        k = k_cache[:, blocks].float().reshape(kv_heads, -1, d)[:, :n]  # [kv_heads, n, d]
        v = v_cache[:, blocks].float().reshape(kv_heads, -1, d)[:, :n]
        if k_scale is not None:
            k = k * k_scale.view(kv_heads, 1, 1)
        if v_scale is not None:
            v = v * v_scale.view(kv_heads, 1, 1)
        qi = q[i].float().view(kv_heads, h // kv_heads, d)  # head j * G + g -> kv head j
        p = torch.softmax(qi @ k.transpose(1, 2) * scale, dim=-1)  # [kv_heads, G, n]
        out[i] = (p @ v).reshape(h, d)
    return out.to(q.dtype)
