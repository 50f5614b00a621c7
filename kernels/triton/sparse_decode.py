"""Block-sparse paged decode: exact attention over each (request, KV head)'s selected blocks only
(chosen by quest_select.py). Blocks are named by their POSITION j in the request's block table
(block id = block_tables[r, j]).

`sparse_paged_decode` is split-KV (flash-decoding) attention over the selected lists.
    grid (b, kv_heads, num_splits); a program takes its KV head's query group as one [G_PAD, d] tile
    (G_PAD = max(16, next_pow2(G))), its share of the selected list (ceil(n / num_splits) entries),
    and for each entry reads one whole block of K and V: per program G * d of q, plus per entry
    one position, one table entry and 2 * block_size * d cache elements. It writes G partial outputs
    (d fp32) and log-sum-exps, merged by `split_reduce.merge_splits`.

`sparse_decode_bytes` gives the bytes it reads, for benchmarks. The wrapper does not sync with the
device, so it can be captured in a CUDA graph. Under TRITON_INTERPRET=1 every load is cast to fp32
first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sparse_checks import check_device, check_float, check_heads, check_index, is_int, itemsize
from .split_reduce import merge_splits


@triton.jit
def _sparse_decode_kernel(
    q,  # [b, H, d]
    k_cache,  # [kv_heads, num_blocks, block_size, d]
    v_cache,  # [kv_heads, num_blocks, block_size, d]
    block_tables,  # [b, max_blocks]
    selected,  # [b, kv_heads, n] block positions, -1: none
    context_lens,  # [b]
    partial_out,  # [b, H, S, d] fp32
    partial_lse,  # [b, H, S] fp32
    scale,
    stride_qb,
    stride_qh,
    stride_kh,
    stride_kb,
    stride_kt,
    stride_vh,
    stride_vb,
    stride_vt,
    stride_tb,
    stride_tj,
    stride_sb,
    stride_sh,
    stride_sn,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    max_blocks,
    num_selected,
    per_split,  # selected entries per split (a runtime value: batch sizes do not recompile)
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)  # head * stride may pass 2^31
    split = tl.program_id(2)
    length = tl.load(context_lens + row).to(tl.int64)
    g = tl.arange(0, G_PAD)
    dd = tl.arange(0, BLOCK_D)
    g_ok = g < G
    d_ok = dd < HEAD_DIM
    q_heads = head * G + g
    qg = tl.load(
        q + row * stride_qb + q_heads[:, None] * stride_qh + dd[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)  # [G_PAD, BLOCK_D]
    t = tl.arange(0, TILE_BLOCKS * BLOCK_SIZE)  # a tile of TILE_BLOCKS whole blocks
    entry_of = t // BLOCK_SIZE
    offset = t % BLOCK_SIZE
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    den = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_D], dtype=tl.float32)
    sel_row = selected + row * stride_sb + head * stride_sh
    lo = split * per_split
    hi = tl.minimum(lo + per_split, num_selected)
    for e0 in range(lo, hi, TILE_BLOCKS):
        e = e0 + entry_of
        pos = tl.load(sel_row + e * stride_sn, mask=e < hi, other=-1).to(tl.int64)
        ok = (pos >= 0) & (pos < max_blocks)
        bid = tl.load(block_tables + row * stride_tb + pos * stride_tj, mask=ok, other=0).to(tl.int64)
        ok = ok & (pos * BLOCK_SIZE + offset < length)
        kt = tl.load(
            k_cache + head * stride_kh + bid[None, :] * stride_kb + offset[None, :] * stride_kt + dd[:, None],
            mask=ok[None, :] & d_ok[:, None],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_D, TILE_N]
        s = tl.dot(qg, kt) * scale  # [G_PAD, TILE_N]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m - m_use)
        v = tl.load(
            v_cache + head * stride_vh + bid[:, None] * stride_vb + offset[:, None] * stride_vt + dd[None, :],
            mask=ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [TILE_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p, v)
        den = den * alpha + tl.sum(p, axis=1)
        m = m_new
    seen = den > 0
    o = acc / tl.where(seen, den, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, den, 1.0)), float("-inf"))
    tl.store(
        partial_out + row * stride_pb + q_heads[:, None] * stride_ph + split * stride_ps + dd[None, :],
        o,
        mask=g_ok[:, None] & d_ok[None, :],
    )
    tl.store(partial_lse + row * stride_lb + q_heads * stride_lh + split, lse, mask=g_ok)


TARGET_PROGRAMS = 256  # default splits aim at about this many programs (an H200 has 132 SMs)
MAX_SPLITS = 32
MIN_BLOCKS_PER_SPLIT = 4


def default_num_splits(batch: int, num_kv_heads: int, num_selected: int) -> int:
    """Enough splits to fill the GPU, each of at least MIN_BLOCKS_PER_SPLIT selected blocks."""
    want = -(-TARGET_PROGRAMS // max(1, batch * num_kv_heads))
    most = -(-num_selected // MIN_BLOCKS_PER_SPLIT)
    return max(1, min(want, most, MAX_SPLITS))


def sparse_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    selected: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of each decode query over its KV head's selected blocks.

    q: [b, H, d] fp32/fp16/bf16; k_cache, v_cache: [kv_heads, num_blocks, block_size, d] (any
    strides, last dim contiguous; block_size a power of two); block_tables: [b, max_blocks];
    selected: [b, kv_heads, n] block positions (-1 or out of the table: none; no duplicates);
    context_lens: [b]; out: [b, H, d] (default: new, q's dtype). Tokens at positions >= len are
    masked; a head with nothing selected gets 0."""
    _check_decode(q, k_cache, v_cache, block_tables, selected, context_lens, scale, num_splits, out)
    b, heads, d = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    n = selected.shape[2]
    if out is None:
        out = torch.empty(b, heads, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if n == 0:
        return out.zero_()
    splits = default_num_splits(b, kv_heads, n) if num_splits is None else num_splits
    per_split = -(-n // splits)
    if num_splits is None:
        splits = -(-n // per_split)  # no empty splits
    tile_blocks = max(min(max(1, 64 // block_size), triton.next_power_of_2(per_split)), -(-16 // block_size))
    partial_out = torch.empty(b, heads, splits, d, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(b, heads, splits, dtype=torch.float32, device=q.device)
    group = heads // kv_heads
    _sparse_decode_kernel[(b, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        selected,
        context_lens,
        partial_out,
        partial_lse,
        float(scale),
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        *block_tables.stride(),
        *selected.stride(),
        *partial_out.stride()[:3],
        *partial_lse.stride()[:2],
        block_tables.shape[1],
        n,
        per_split,
        G=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_SIZE=block_size,
        TILE_BLOCKS=tile_blocks,
    )
    return merge_splits(partial_out, partial_lse, out)


def sparse_paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    selected: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`sparse_paged_decode` in PyTorch, one (row, KV head) at a time -> [b, H, d] fp32."""
    b, heads, d = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group, max_blocks = heads // kv_heads, block_tables.shape[1]
    out = torch.zeros(b, heads, d, dtype=torch.float32, device=q.device)
    for r in range(b):
        for h in range(kv_heads):
            pos = [p for p in selected[r, h].tolist() if 0 <= p < max_blocks]
            if not pos:
                continue
            ids = block_tables[r, pos].long()
            k = k_cache[h, ids].float().reshape(-1, d)  # [len(pos) * block_size, d]
            v = v_cache[h, ids].float().reshape(-1, d)
            tokens = torch.tensor(pos, device=q.device)[:, None] * block_size + torch.arange(
                block_size, device=q.device
            )
            keep = tokens.reshape(-1) < int(context_lens[r])
            if not bool(keep.any()):
                continue
            qg = q[r, h * group : (h + 1) * group].float()
            w = torch.softmax(qg @ k[keep].T * scale, dim=-1)
            out[r, h * group : (h + 1) * group] = w @ v[keep]
    return out


def sparse_decode_bytes(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_selected: int,
    block_size: int,
    kv_dtype: torch.dtype = torch.float16,
    q_dtype: torch.dtype = torch.float16,
    num_splits: int = 1,
    index_bytes: int = 4,
) -> int:
    """Bytes `sparse_paged_decode` reads at most (every list full): each program its query group,
    then per selected block its position, its table entry, and a block of K and of V; plus the
    merge's fp32 partials."""
    q_bytes = num_splits * batch * num_heads * head_dim * itemsize(q_dtype)
    per_block = 2 * block_size * head_dim * itemsize(kv_dtype) + 2 * index_bytes
    partials = batch * num_heads * num_splits * (head_dim + 1) * 4
    return q_bytes + batch * num_kv_heads * num_selected * per_block + partials


def _check_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    selected: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    out: torch.Tensor | None,
) -> None:
    check_float("q", q, 3)
    check_float("k_cache", k_cache, 4)
    check_float("v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    kv_heads, _, block_size, head_dim = k_cache.shape
    check_heads(q, kv_heads, head_dim)
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    b = q.shape[0]
    check_index("block_tables", block_tables, (b, -1))
    check_index("selected", selected, (b, kv_heads, -1))
    check_index("context_lens", context_lens, (b,))
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise ValueError(f"scale must be a Python number, got {type(scale).__name__}")
    if num_splits is not None and (not is_int(num_splits) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": block_tables}
    tensors |= {"selected": selected, "context_lens": context_lens}
    if out is not None:
        check_float("out", out, 3)
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
        tensors["out"] = out
    check_device(**tensors)
