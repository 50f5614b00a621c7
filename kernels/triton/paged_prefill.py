"""Paged prefill attention: chunks of several requests, each after its cached prefix, attending to
the prefix and to their own keys straight from the paged KV cache (no gather copy), so chunked
prefill and prefix-cache hits cost one kernel launch per layer.

    out[i] = softmax_j(scale * q[i] . k[j]) v[j],   j = 0 .. start_pos + i

Query i of a chunk sits at absolute position start_pos + i: it sees the whole cached prefix and its
own chunk causally. The chunk's keys and values are already in the cache. Online softmax as in
FlashAttention-2, in fp32 (exp2 with the scale folded into log2 units).

GQA packing: the G query heads sharing a KV head are folded into the M dimension (packed row r of a
chunk is token r // G, query head kv_head * G + r % G), so each key tile is loaded once per KV head
and a short chunk after a long prefix (a question after a cached document) still fills its tiles.

Grid: (sequences, cdiv(max_q_len * G, BLOCK_M), kv_heads). A program reads its BLOCK_M packed query
rows once (BLOCK_M * d), then, for every key position up to its last token's, one block-table entry,
one key row and one value row (2 * d each, through the table: any block order). Key tiles below its
first token's position run without a mask; tiles above its last token's are never visited.
Positions are int32 (a context under 2^31 tokens); cache offsets are int64.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INTS = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634
# (fp32 dot, head_dim) -> BLOCK_M, BLOCK_N, num_warps, from compiling for sm_90 with Triton 3.7 (no
# GPU at hand, so not timed): the largest tiles without register spills for GQA groups 1, 3 and 8,
# but for 16-bit d = 128, where every tile of 64+ rows spills a little (80-144 bytes a thread here).
# fp32 inputs take the ieee dot, on the FMA units: small tiles.
_TILES = {
    (False, 64): (128, 32, 8),
    (False, 128): (64, 16, 8),
    (True, 64): (64, 16, 8),
    (True, 128): (32, 16, 8),
}


@triton.jit
def _attend_keys(
    acc,  # [BLOCK_M, HEAD_DIM] fp32, unnormalised output
    l_i,  # [BLOCK_M] fp32, softmax denominators
    m_i,  # [BLOCK_M] fp32, running maxima (log2 units)
    q,  # [BLOCK_M, HEAD_DIM] fp32
    q_pos,  # [BLOCK_M] absolute position of each packed row's token
    k_head,  # this KV head's keys: [num_blocks, block_size, d] by strides
    v_head,
    table,  # this sequence's block-table row
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    qk_scale,  # scale * log2(e)
    lo,  # first key position (a multiple of BLOCK_N)
    hi,  # one past the last key position
    ctx_end,  # positions at and after this are not in the context of any row
    CAUSAL: tl.constexpr,  # mask keys after each row's own position
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    dd = tl.arange(0, HEAD_DIM)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < ctx_end
        blk = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = k_pos % BLOCK_SIZE
        k = tl.load(
            k_head + blk[None, :] * stride_kb + slot[None, :] * stride_kt + dd[:, None],
            mask=k_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [HEAD_DIM, BLOCK_N]
        v = tl.load(
            v_head + blk[:, None] * stride_vb + slot[:, None] * stride_vt + dd[None, :],
            mask=k_ok[:, None],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, HEAD_DIM]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if CAUSAL:
            s = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :], s, float("-inf"))
        # every row saw key 0 in the first tile visited, so m_new is finite from then on
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _paged_prefill_kernel(
    q,  # [T, H, d]
    k_cache,  # [kv_heads, num_blocks, block_size, d]
    v_cache,
    block_tables,  # [s, max_blocks]
    cu_seqlens_q,  # [s + 1]
    start_pos,  # [s]
    out,  # [T, H, d]
    stride_qt,
    stride_qh,
    stride_kh,
    stride_kb,
    stride_kt,
    stride_vh,
    stride_vb,
    stride_vt,
    stride_bt,
    stride_ot,
    stride_oh,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    row0 = tl.program_id(1) * BLOCK_M
    kv_head = tl.program_id(2)
    q_begin = tl.load(cu_seqlens_q + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_q + seq + 1).to(tl.int32) - q_begin
    if row0 >= q_len * GROUP:
        return  # the grid is sized for the longest chunk
    start = tl.load(start_pos + seq).to(tl.int32)

    rows = row0 + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = tok < q_len
    q_pos = start + tok
    dd = tl.arange(0, HEAD_DIM)
    q_off = (q_begin + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dd[None, :]
    qv = tl.load(q + q_off, mask=row_ok[:, None], other=0.0).to(tl.float32)

    # keys before the tile's first token's position are seen by every row: no mask there
    first_tok = row0 // GROUP
    last_tok = tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
    full_hi = (start + first_tok + 1) // BLOCK_N * BLOCK_N
    ctx_end = start + last_tok + 1

    k_head = k_cache + kv_head.to(tl.int64) * stride_kh
    v_head = v_cache + kv_head.to(tl.int64) * stride_vh
    table = block_tables + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, qv, q_pos, k_head, v_head, table,
        stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, 0, full_hi, ctx_end,
        False, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DOT_PRECISION,
    )  # fmt: skip
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, qv, q_pos, k_head, v_head, table,
        stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, full_hi, ctx_end, ctx_end,
        True, BLOCK_SIZE, BLOCK_N, HEAD_DIM, DOT_PRECISION,
    )  # fmt: skip
    acc = acc / l_i[:, None]
    o_off = (q_begin + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dd[None, :]
    tl.store(out + o_off, acc.to(out.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    start_pos: torch.Tensor,
    scale: float,
    *,
    max_q_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of s chunks, each after its cached prefix, reading keys from the paged cache.

    q: [T, H, d] fp32/fp16/bf16, the chunks' tokens concatenated; k_cache, v_cache: [kv_heads,
    num_blocks, block_size, d] (one dtype, any strides with the last dim contiguous), holding every
    position 0 .. start_pos + len - 1 of each sequence, the chunk's own included; block_tables:
    [s, max_blocks] int32/int64; cu_seqlens_q: [s + 1] int32/int64 prefix sums of the chunk lengths;
    start_pos: [s] int32/int64 tokens cached before each chunk; max_q_len: the longest chunk (a
    Python int: the grid needs no host sync). H = kv_heads * G; query head h reads KV head h // G.
    d: 64 or 128; block_size: a power of two. Returns out: [T, H, d] in q.dtype.

    Shapes, dtypes, devices and strides are always checked. The values (cu_seqlens, start_pos,
    the block ids) are checked on the CPU only, where it costs nothing; on a GPU that would be a host
    sync per layer, so there the caller's metadata is trusted (a wrong max_q_len leaves rows unset).
    """
    _check_shapes(q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos, max_q_len)
    kv_heads, num_blocks, block_size, d = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous last dim")
    if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if q.device.type == "cpu":
        _check_values(q.shape[0], num_blocks, block_size, block_tables, cu_seqlens_q, start_pos, max_q_len)
    num_seqs = start_pos.shape[0]
    group = q.shape[1] // kv_heads
    if q.shape[0] == 0 or max_q_len == 0 or num_seqs == 0:
        return out
    exact = torch.float32 in (q.dtype, k_cache.dtype)
    block_m, block_n, warps = _TILES[exact, d]
    grid = (num_seqs, triton.cdiv(max_q_len * group, block_m), kv_heads)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        cu_seqlens_q,
        start_pos,
        out,
        *q.stride()[:2],
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        *out.stride()[:2],
        float(scale) * _LOG2E,
        GROUP=group,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=d,
        # fp16 / bf16 values are exact in tf32 (p rounds to 11 bits, finer than the 16-bit output);
        # fp32 needs the ieee dot for 1e-5 agreement
        DOT_PRECISION="ieee" if exact else "tf32",
        num_warps=warps,
    )
    return out


def _check_shapes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    start_pos: torch.Tensor,
    max_q_len: int,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or block_tables.dim() != 2:
        raise ValueError(
            "paged_prefill wants q [T, H, d], k_cache / v_cache [kv_heads, num_blocks, block_size, d], "
            f"block_tables [s, max_blocks]; got {tuple(q.shape)}, {tuple(k_cache.shape)}, "
            f"{tuple(block_tables.shape)}"
        )
    kv_heads, _, block_size, d = k_cache.shape
    s = start_pos.shape[0] if start_pos.dim() == 1 else -1
    if (
        v_cache.shape != k_cache.shape
        or q.shape[2] != d
        or kv_heads == 0
        or q.shape[1] % kv_heads
        or cu_seqlens_q.shape != (s + 1,)
        or block_tables.shape[0] != s
    ):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
            f"{tuple(v_cache.shape)}, block_tables {tuple(block_tables.shape)}, cu_seqlens_q "
            f"{tuple(cu_seqlens_q.shape)}, start_pos {tuple(start_pos.shape)}"
        )
    if d not in (64, 128) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"head_dim must be 64 or 128 and block_size a power of two; got {d}, {block_size}")
    if q.dtype not in _FLOATS or k_cache.dtype not in _FLOATS or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            "q and the caches must be fp32/fp16/bf16, the caches alike; "
            f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    for name, t in (("block_tables", block_tables), ("cu_seqlens_q", cu_seqlens_q), ("start_pos", start_pos)):
        if t.dtype not in _INTS:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if len({t.device for t in (q, k_cache, v_cache, block_tables, cu_seqlens_q, start_pos)}) != 1:
        raise ValueError("all tensors must be on one device")
    if isinstance(max_q_len, bool) or not isinstance(max_q_len, int) or max_q_len < 0:
        raise ValueError(f"max_q_len must be a non-negative int, got {max_q_len!r}")


def _check_values(
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    start_pos: torch.Tensor,
    max_q_len: int,
) -> None:
    lens = cu_seqlens_q.diff()
    if int(cu_seqlens_q[0]) != 0 or int(cu_seqlens_q[-1]) != num_tokens or bool((lens < 0).any()):
        raise ValueError(f"cu_seqlens_q must rise from 0 to T = {num_tokens}: {cu_seqlens_q.tolist()}")
    if lens.numel() and int(lens.max()) > max_q_len:
        raise ValueError(f"a chunk of {int(lens.max())} tokens is longer than max_q_len = {max_q_len}")
    if bool((start_pos < 0).any()):
        raise ValueError(f"start_pos must not be negative: {start_pos.tolist()}")
    used = -(-(start_pos + lens) // block_size)  # blocks each sequence's context spans
    if used.numel() and int(used.max()) > block_tables.shape[1]:
        raise ValueError(f"block_tables [{block_tables.shape[1]} blocks] do not cover the contexts")
    live = torch.arange(block_tables.shape[1]) < used[:, None]
    ids = block_tables[live]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block ids must lie in 0..{num_blocks - 1}")


def paged_prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    start_pos: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention in PyTorch, one sequence at a time: gather the context's positions, mask
    the scores in fp32, softmax. -> [T, H, d] in q.dtype."""
    out = torch.empty_like(q)
    kv_heads, _, block_size, _ = k_cache.shape
    group = q.shape[1] // kv_heads
    for s in range(start_pos.shape[0]):
        lo, hi = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1])
        n, start = hi - lo, int(start_pos[s])
        pos = torch.arange(start + n, device=q.device)
        blocks = block_tables[s].long()[pos // block_size]
        k = k_cache[:, blocks, pos % block_size].float().repeat_interleave(group, 0)  # [H, ctx, d]
        v = v_cache[:, blocks, pos % block_size].float().repeat_interleave(group, 0)
        scores = torch.einsum("nhd,hcd->hnc", q[lo:hi].float(), k) * scale  # [H, n, ctx]
        visible = pos[None, :] <= (start + torch.arange(n, device=q.device))[:, None]  # [n, ctx]
        p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[lo:hi] = torch.einsum("hnc,hcd->nhd", p, v).to(q.dtype)
    return out
