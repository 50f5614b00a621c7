"""Quest block selection for block-sparse paged decode: choose each (request, KV head)'s blocks by
their key bounds; sparse_decode.py then attends exactly over the chosen blocks only.

Blocks are named by their POSITION j in the request's block table (block id = block_tables[r, j]),
nblk = ceil(len / block_size) of them (capped at the table width). Per (request r, KV head h):

    sinks   [0, min(S, nblk))                        always kept
    middle  [S, nblk - W)                            the top `top_k` by Quest bound are kept
    window  [max(nblk - W, S), nblk)                 always kept (S = sink_blocks, W = window_blocks)

The bound of a middle block is the best over the head's query group of
sum_c max(q_c * kmin_c, q_c * kmax_c) = q+ . kmax + q- . kmin, from the per-block key summaries
kmin / kmax [kv_heads, num_blocks, d]. Ties go to the lower position; a block whose bound is -inf
(no keys summarized) or NaN is never picked. A short row (nblk < S + W) keeps all its blocks once each.

`quest_select` fuses scoring and top-k: no score reaches memory.
    grid (b, kv_heads); a program walks its middle in tiles of BLOCK_N blocks, scores a tile with two
    [G_PAD, d] x [d, BLOCK_N] dots, and merges it into a running top-BLOCK_N kept in registers as
    packed int64 keys (monotone fp32 bits << 32 | (2^31 - 1 - position)): sort the running keys
    ascending, the tile's descending, and their elementwise max is the top-BLOCK_N of the union
    (a bitonic half-cleaner). Reads per program: G * d of q, (middle blocks) * (2 * d * 2 bytes of
    summaries + one table entry), writes S + top_k + W int32 positions.

`quest_select_bytes` gives the bytes it reads, for benchmarks. The wrapper does not sync with the
device (grids and constexprs come from shapes and Python ints), so it can be captured in a CUDA
graph. Under TRITON_INTERPRET=1 every load is cast to fp32 first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sparse_checks import check_select, is_int, itemsize

MAX_TOP_K = 1024  # the running top-k lives in registers: BLOCK_N = next_pow2(top_k) keys


@triton.jit
def _quest_score_tile(
    q_row,  # pointer to the group's first query head
    kmin_head,
    kmax_head,
    ids,  # [BLOCK_N] block ids of the tile
    ok,  # [BLOCK_N] which tile entries are middle blocks
    stride_qh,
    stride_nb,  # kmin's block stride
    stride_xb,  # kmax's
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
):
    """The tile's Quest bounds [BLOCK_N]: max over the group of q+ . kmax + q- . kmin."""
    g = tl.arange(0, G_PAD)
    dk = tl.arange(0, BLOCK_DK)
    acc = tl.zeros([G_PAD, BLOCK_N], dtype=tl.float32)
    for d0 in range(0, HEAD_DIM, BLOCK_DK):
        dd = d0 + dk
        q = tl.load(
            q_row + g[:, None] * stride_qh + dd[None, :],
            mask=(g[:, None] < G) & (dd[None, :] < HEAD_DIM),
            other=0.0,
        ).to(tl.float32)  # [G_PAD, BLOCK_DK]
        kmask = (dd[:, None] < HEAD_DIM) & ok[None, :]  # tiles [BLOCK_DK, BLOCK_N]: loaded transposed
        hi = tl.load(kmax_head + ids[None, :] * stride_xb + dd[:, None], mask=kmask, other=0.0).to(tl.float32)
        lo = tl.load(kmin_head + ids[None, :] * stride_nb + dd[:, None], mask=kmask, other=0.0).to(tl.float32)
        acc += tl.dot(tl.maximum(q, 0.0), hi, input_precision="ieee")
        acc += tl.dot(tl.minimum(q, 0.0), lo, input_precision="ieee")
    acc = tl.where(g[:, None] < G, acc, float("-inf"))
    return tl.max(acc, axis=0)


@triton.jit
def _quest_select_kernel(
    q,  # [b, H, d]
    kmin,  # [kv_heads, num_blocks, d]
    kmax,  # [kv_heads, num_blocks, d]
    block_tables,  # [b, max_blocks]
    context_lens,  # [b]
    selected,  # [b, kv_heads, TOTAL] int32 out
    stride_qb,
    stride_qh,
    stride_nh,
    stride_nb,
    stride_xh,
    stride_xb,
    stride_tb,
    stride_tj,
    stride_sb,
    stride_sh,
    max_blocks,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SINKS: tl.constexpr,
    WINDOW: tl.constexpr,
    TOP_K: tl.constexpr,
    TOTAL: tl.constexpr,
    OUT_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DK: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)  # head * stride may pass 2^31
    length = tl.load(context_lens + row).to(tl.int32)
    nblk = tl.minimum((length + BLOCK_SIZE - 1) // BLOCK_SIZE, max_blocks)
    nblk = tl.maximum(nblk, 0)
    n_sink = tl.minimum(nblk, SINKS)
    mid_end = nblk - WINDOW  # the middle is [SINKS, mid_end)
    win_start = tl.maximum(mid_end, SINKS)
    n_win = tl.maximum(nblk - win_start, 0)
    n_top = 0
    out_row = selected + row * stride_sb + head * stride_sh
    if TOP_K > 0:
        lane = tl.arange(0, BLOCK_N)
        best = tl.full([BLOCK_N], -(2**63), tl.int64)  # below every real key
        for start in range(SINKS, mid_end, BLOCK_N):
            pos = start + lane
            ok = pos < mid_end
            ids = tl.load(block_tables + row * stride_tb + pos * stride_tj, mask=ok, other=0).to(tl.int64)
            score = _quest_score_tile(
                q + row * stride_qb + head * G * stride_qh,
                kmin + head * stride_nh,
                kmax + head * stride_xh,
                ids,
                ok,
                stride_qh,
                stride_nb,
                stride_xb,
                G,
                G_PAD,
                HEAD_DIM,
                BLOCK_N,
                BLOCK_DK,
            )
            score = tl.where(score == 0.0, 0.0, score)  # -0.0 and 0.0 are one score
            bits = score.to(tl.int32, bitcast=True)
            mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # fp32 order as signed int order
            key = (mono.to(tl.int64) << 32) | (0x7FFFFFFF - pos).to(tl.int64)
            key = tl.where(ok & (score > float("-inf")), key, -(2**63))  # never -inf or NaN
            # bitonic half-cleaner: the elementwise max of an ascending and a descending sequence
            # holds the largest BLOCK_N of both
            best = tl.maximum(tl.sort(best), tl.sort(key, descending=True))
        best = tl.sort(best, descending=True)
        keep = (lane < TOP_K) & (best != -(2**63))
        n_top = tl.sum(keep.to(tl.int32), axis=0)
        top = 0x7FFFFFFF - (best & 0x7FFFFFFF).to(tl.int32)  # the low word is < 2^31
        top = tl.sort(tl.where(keep, top, 0x7FFFFFFF))  # chosen positions ascending, first
        tl.store(out_row + n_sink + lane, top, mask=lane < n_top)
    # sinks, then (the top blocks above), then the window, then -1 up to TOTAL
    i = tl.arange(0, OUT_PAD)
    win_at = n_sink + n_top
    fill_at = win_at + n_win
    val = tl.where(i < n_sink, i, tl.where(i < fill_at, win_start + i - win_at, -1))
    tl.store(out_row + i, val, mask=(i < TOTAL) & ((i < n_sink) | (i >= win_at)))


def quest_select(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sink_blocks: int,
    window_blocks: int,
    top_k: int,
    *,
    block_size: int,
    block_n: int | None = None,
) -> torch.Tensor:
    """Quest block selection. q: [b, H, d] fp32/fp16/bf16; kmin, kmax: [kv_heads, num_blocks, d] (any
    float; last dim contiguous); block_tables: [b, max_blocks] int32/int64; context_lens: [b]
    int32/int64; block_size: tokens per block (nblk = ceil(len / block_size), capped at max_blocks).
    -> [b, kv_heads, sink_blocks + top_k + window_blocks] int32 block positions:
    ascending, then -1 for unused entries. block_n: middle blocks scored per tile, a power of two
    >= max(16, top_k) (default max(32, next_pow2(top_k))); it is also the running top-k's size."""
    check_select(q, kmin, kmax, block_tables, context_lens, sink_blocks, window_blocks, top_k, block_size)
    if top_k > MAX_TOP_K:
        raise ValueError(f"top_k {top_k} is above {MAX_TOP_K} (the running top-k lives in registers)")
    least = max(16, triton.next_power_of_2(top_k))
    if block_n is not None and (
        not is_int(block_n) or not least <= block_n <= MAX_TOP_K or block_n & (block_n - 1)
    ):
        raise ValueError(f"block_n must be a power of two in [{least}, {MAX_TOP_K}], got {block_n!r}")
    b, heads, d = q.shape
    kv_heads = kmin.shape[0]
    group = heads // kv_heads
    total = sink_blocks + top_k + window_blocks
    selected = torch.empty(b, kv_heads, total, dtype=torch.int32, device=q.device)
    if b == 0 or total == 0:
        return selected
    block_n = max(32, least) if block_n is None else block_n
    block_dk = max(16, min(64, triton.next_power_of_2(d), 4096 // block_n))
    _quest_select_kernel[(b, kv_heads)](
        q,
        kmin,
        kmax,
        block_tables,
        context_lens,
        selected,
        q.stride(0),
        q.stride(1),
        kmin.stride(0),
        kmin.stride(1),
        kmax.stride(0),
        kmax.stride(1),
        block_tables.stride(0),
        block_tables.stride(1),
        selected.stride(0),
        selected.stride(1),
        block_tables.shape[1],
        G=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        SINKS=sink_blocks,
        WINDOW=window_blocks,
        TOP_K=top_k,
        TOTAL=total,
        OUT_PAD=triton.next_power_of_2(total),
        BLOCK_N=block_n,
        BLOCK_DK=block_dk,
    )
    return selected


def quest_select_reference(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sink_blocks: int,
    window_blocks: int,
    top_k: int,
    *,
    block_size: int,
) -> torch.Tensor:
    """`quest_select` in PyTorch, one (row, KV head) at a time."""
    b, heads, _ = q.shape
    kv_heads, max_blocks = kmin.shape[0], block_tables.shape[1]
    group = heads // kv_heads
    selected = torch.full((b, kv_heads, sink_blocks + top_k + window_blocks), -1, dtype=torch.int32)
    for r in range(b):
        nblk = max(0, min(-(-int(context_lens[r]) // block_size), max_blocks))
        middle = list(range(sink_blocks, nblk - window_blocks))
        sinks = list(range(min(sink_blocks, nblk)))
        window = list(range(max(nblk - window_blocks, sink_blocks), nblk))
        for h in range(kv_heads):
            chosen: list[int] = []
            if middle and top_k:
                ids = block_tables[r, middle].long().cpu()
                lo, hi = kmin[h].cpu()[ids].float(), kmax[h].cpu()[ids].float()  # [m, d]
                qg = q[r, h * group : (h + 1) * group].cpu().float()  # [group, d]
                bound = (qg.clamp(min=0) @ hi.T + qg.clamp(max=0) @ lo.T).amax(0)  # [m]
                order = torch.sort(bound, descending=True, stable=True).indices[:top_k]
                chosen = sorted(middle[i] for i in order.tolist() if bound[i] > -torch.inf)
            positions = sinks + chosen + window
            selected[r, h, : len(positions)] = torch.tensor(positions, dtype=torch.int32)
    return selected.to(q.device)


def quest_select_bytes(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    context_len: int,
    block_size: int,
    sink_blocks: int,
    window_blocks: int,
    q_dtype: torch.dtype = torch.float16,
    summary_dtype: torch.dtype = torch.float16,
    index_bytes: int = 4,
) -> int:
    """Bytes `quest_select` reads for `batch` rows of `context_len` tokens each: each program its
    query group once, then two summaries and one table entry per middle block."""
    nblk = -(-context_len // block_size)
    middle = max(0, nblk - sink_blocks - window_blocks)
    q_bytes = batch * num_heads * head_dim * itemsize(q_dtype)
    per_block = 2 * head_dim * itemsize(summary_dtype) + index_bytes
    return q_bytes + batch * num_kv_heads * middle * per_block + batch * index_bytes
