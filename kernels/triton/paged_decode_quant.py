"""Paged decode attention (one new query per request) over an int8 / int4 quantized KV cache, split-KV
(flash-decoding) and GQA-packed, dequantizing in registers: no full-precision copy of the cache.

Cache layout (per layer, as cloud/engine/kv/quantized_cache.py keeps it):

    kq, vq          [kv_heads, num_blocks, block_size, w] uint8 codes; w = d (int8) or d / 2 (int4:
                    even channel in the low nibble, odd channel in the high nibble)
    kmin, kmax      [kv_heads, num_blocks, d] fp16: per block and channel, key = kmin + code * step,
                    step = (kmax - kmin) / levels in fp32 (1 where not > 0), rounded to fp16
    vscale, vzero   [kv_heads, num_blocks, block_size] fp16: per token, value = vzero + code * vscale
    stage_of        [num_blocks] int: -1, or the staging slot of a partly filled block, whose keys and
                    values are read in full precision from stage_k / stage_v [kv_heads, slots, bs, d]

Grid: (requests, kv_heads, num_splits). A program loads its KV head's whole query group [G_PAD, d]
(G_PAD = max(16, next_pow2(group)), padding rows masked) so each KV tile serves the group, and walks
its share of the request's blocks: per block it reads bs * w bytes of key codes and as many of value
codes, 2 * d fp16 key parameters and 2 * bs fp16 value parameters (or, for a staged block, 2 * bs * d
full-precision values instead). Scores and the online softmax are fp32; each split writes its
normalized partial output [G, d] and log-sum-exp, and `merge_splits` combines the splits. With one
split the program writes the output itself.

The wrapper never reads device memory on the host (no sync, CUDA-graph safe): block ids, staging
slots and context lengths are not range-checked; table entries past ceil(len / bs) are never read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .split_reduce import merge_splits, sm_count

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INDICES = (torch.int32, torch.int64)
_HEAD_DIMS = (64, 128)
_MAX_SPLITS = 64
_PROGRAMS_PER_SM = 4


@triton.jit
def _load_codes(ptr, tok, ok, stride_t, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    """One block's codes [BLOCK_SIZE, HEAD_DIM] as fp32; int4 bytes unpack into even / odd channels."""
    if BITS == 8:
        c = tl.arange(0, HEAD_DIM)
        codes = tl.load(ptr + tok[:, None] * stride_t + c[None, :], mask=ok[:, None], other=0)
    else:
        c = tl.arange(0, HEAD_DIM // 2)
        packed = tl.load(ptr + tok[:, None] * stride_t + c[None, :], mask=ok[:, None], other=0)
        codes = tl.interleave(packed & 15, packed >> 4)
    return codes.to(tl.float32)


@triton.jit
def _load_rows(ptr, tok, ok, stride_t, HEAD_DIM: tl.constexpr):
    """One staged block's full-precision rows [BLOCK_SIZE, HEAD_DIM] as fp32."""
    c = tl.arange(0, HEAD_DIM)
    return tl.load(ptr + tok[:, None] * stride_t + c[None, :], mask=ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _paged_decode_quant_kernel(
    q,  # [b, H, d]
    kq,  # [kv_heads, num_blocks, bs, w] uint8 (vq: the same strides)
    vq,
    kmin,  # [kv_heads, num_blocks, d] fp16 (kmax: the same strides)
    kmax,
    vscale,  # [kv_heads, num_blocks, bs] fp16 (vzero: the same strides)
    vzero,
    stage_of,  # [num_blocks] int
    stage_k,  # [kv_heads, slots, bs, d] (stage_v: the same strides)
    stage_v,
    block_tables,  # [b, max_blocks] int
    context_lens,  # [b] int
    part_out,  # [b, H, S, d]: fp32 partials, or the output itself when S == 1
    part_lse,  # [b, H, S] fp32 (unused when S == 1)
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_ch,
    stride_cb,
    stride_ct,
    stride_mh,
    stride_mb,
    stride_sh,
    stride_sb,
    stride_gh,
    stride_gs,
    stride_gt,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens + row)
    n_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    per_split = tl.cdiv(n_blocks, NUM_SPLITS)
    first = split * per_split
    last = tl.minimum(first + per_split, n_blocks)

    g = tl.arange(0, G_PAD)
    dd = tl.arange(0, HEAD_DIM)
    tok = tl.arange(0, BLOCK_SIZE)
    heads = kvh * GROUP + g
    g_ok = g < GROUP
    qg = tl.load(
        q + row * stride_qb + heads[:, None] * stride_qh + dd[None, :], mask=g_ok[:, None], other=0.0
    )
    qg = qg.to(tl.float32) * qk_scale  # [G_PAD, d], scores come out in log2 units

    head64 = kvh.to(tl.int64)
    codes_h = head64 * stride_ch
    params_h = head64 * stride_mh
    vparams_h = head64 * stride_sh
    stage_h = head64 * stride_gh
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, HEAD_DIM], tl.float32)
    for i in range(first, last):
        blk = tl.load(block_tables + row * stride_tb + i).to(tl.int64)
        slot = tl.load(stage_of + blk).to(tl.int64)
        tok_ok = i * BLOCK_SIZE + tok < ctx
        quant = tok_ok & (slot < 0)  # read the codes, or else the staged rows: never both
        staged = tok_ok & (slot >= 0)
        codes_at = codes_h + blk * stride_cb
        stage_at = stage_h + tl.maximum(slot, 0) * stride_gs

        # keys: zero kmin and step key_scale(kmin, kmax) per channel, the step rounded to fp16
        lo = tl.load(kmin + params_h + blk * stride_mb + dd, mask=slot < 0, other=0.0).to(tl.float32)
        hi = tl.load(kmax + params_h + blk * stride_mb + dd, mask=slot < 0, other=0.0).to(tl.float32)
        step = tl.math.div_rn(hi - lo, (1 << BITS) - 1.0)
        step = tl.where(step > 0, step, 1.0).to(tl.float16).to(tl.float32)
        k = lo[None, :] + _load_codes(kq + codes_at, tok, quant, stride_ct, HEAD_DIM, BITS) * step[None, :]
        k = tl.where(staged[:, None], _load_rows(stage_k + stage_at, tok, staged, stride_gt, HEAD_DIM), k)

        # values: zero and scale per token
        vs = tl.load(vscale + vparams_h + blk * stride_sb + tok, mask=quant, other=0.0).to(tl.float32)
        vz = tl.load(vzero + vparams_h + blk * stride_sb + tok, mask=quant, other=0.0).to(tl.float32)
        v = vz[:, None] + _load_codes(vq + codes_at, tok, quant, stride_ct, HEAD_DIM, BITS) * vs[:, None]
        v = tl.where(staged[:, None], _load_rows(stage_v + stage_at, tok, staged, stride_gt, HEAD_DIM), v)

        s = tl.dot(qg, tl.trans(k), input_precision=DOT_PRECISION)  # [G_PAD, BLOCK_SIZE]
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a visited block holds at least one token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0  # a split without blocks (or an empty request) writes 0 and lse -inf
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_ptr = part_out + row * stride_ob + heads[:, None] * stride_oh + split * stride_os + dd[None, :]
    tl.store(o_ptr, o.to(part_out.dtype.element_ty), mask=g_ok[:, None])
    if STORE_LSE:
        lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(part_lse + row * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int, device: torch.device) -> int:
    """Splits per (request, KV head), from shapes only: enough programs to fill the GPU about
    _PROGRAMS_PER_SM deep, at most one split per table block and _MAX_SPLITS; 1 off CUDA (the
    interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device)
    want = triton.cdiv(sms * _PROGRAMS_PER_SM, max(batch * num_kv_heads, 1))
    return max(1, min(want, max_blocks, _MAX_SPLITS))


def _expect(name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    if t.numel() > 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")


def _rank(name: str, t: object, dims: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        got = t.dim() if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dims}-d tensor, got {got}")
    return t


def _check_sizes(heads: int, kv_heads: int, head_dim: int, block_size: int, width: int, bits: int) -> None:
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {_HEAD_DIMS}, got {head_dim}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} KV heads")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of 2 >= 16, got {block_size}")
    if width != (head_dim if bits == 8 else head_dim // 2):
        raise ValueError(f"codes {width} bytes wide do not hold int{bits} vectors of {head_dim} channels")


def _check_inputs(
    q: torch.Tensor,
    cache: dict[str, torch.Tensor],
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    bits: int,
) -> None:
    b, heads, d = _rank("q", q, 3).shape
    h, nb, bs, w = _rank("kq", cache["kq"], 4).shape
    slots = _rank("stage_k", cache["stage_k"], 4).shape[1]
    max_blocks = _rank("block_tables", block_tables, 2).shape[1]
    _check_sizes(heads, h, d, bs, w, bits)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite Python number, got {scale!r}")
    _expect("q", q, (b, heads, d), _FLOATS)
    shapes = {
        "kq": ((h, nb, bs, w), (torch.uint8,)),
        "vq": ((h, nb, bs, w), (torch.uint8,)),
        "kmin": ((h, nb, d), (torch.float16,)),
        "kmax": ((h, nb, d), (torch.float16,)),
        "vscale": ((h, nb, bs), (torch.float16,)),
        "vzero": ((h, nb, bs), (torch.float16,)),
        "stage_of": ((nb,), _INDICES),
        "stage_k": ((h, slots, bs, d), _FLOATS),
        "stage_v": ((h, slots, bs, d), _FLOATS),
    }
    for name, (shape, dtypes) in shapes.items():
        _expect(name, cache[name], shape, dtypes)
    _expect("block_tables", block_tables, (b, max_blocks), _INDICES)
    _expect("context_lens", context_lens, (b,), _INDICES)
    for first, second in (("kq", "vq"), ("kmin", "kmax"), ("vscale", "vzero"), ("stage_k", "stage_v")):
        if cache[first].stride() != cache[second].stride():
            raise ValueError(f"{first} and {second} must have the same strides")
    tensors = [q, block_tables, context_lens, *cache.values()]
    if any(t.device != q.device for t in tensors):
        raise ValueError("all tensors must be on one device (q's)")


def paged_decode_quant(
    q: torch.Tensor,
    kq: torch.Tensor,
    vq: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    vscale: torch.Tensor,
    vzero: torch.Tensor,
    stage_of: torch.Tensor,
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    bits: int,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for one query per request over its paged quantized context.

    q: [b, H, d] fp32 / fp16 / bf16 (query head h reads KV head h // (H / kv_heads)); the cache
    tensors as the module docstring lays them out; block_tables: [b, max_blocks] and context_lens:
    [b] int32 / int64 (tokens including the new one; 0 = a padded row, output 0); bits: 8 or 4;
    d: 64 or 128; block_size: a power of 2 >= 16. Returns out: [b, H, d] in q's dtype (or the given
    `out`, written). num_splits: splits of each context, default `default_num_splits`."""
    cache = {
        "kq": kq,
        "vq": vq,
        "kmin": kmin,
        "kmax": kmax,
        "vscale": vscale,
        "vzero": vzero,
        "stage_of": stage_of,
        "stage_k": stage_k,
        "stage_v": stage_v,
    }
    _check_inputs(q, cache, block_tables, context_lens, scale, bits)
    b, heads, d = q.shape
    kv_heads, _, block_size, _ = kq.shape
    if num_splits is None:
        num_splits = default_num_splits(b, kv_heads, block_tables.shape[1], q.device)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if out is None:
        out = torch.empty_like(q)
    else:
        _expect("out", out, (b, heads, d), _FLOATS)
        if out.device != q.device:
            raise ValueError("out must be on q's device")
    if b == 0:
        return out
    if num_splits == 1:  # the programs write the output itself
        part_out, part_lse = out.unsqueeze(2), out
        lse_strides: tuple[int, ...] = (0, 0)
    else:
        part_out = torch.empty(b, heads, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, heads, num_splits, dtype=torch.float32, device=q.device)
        lse_strides = part_lse.stride()[:2]
    group = heads // kv_heads
    _paged_decode_quant_kernel[(b, kv_heads, num_splits)](
        q,
        kq,
        vq,
        kmin,
        kmax,
        vscale,
        vzero,
        stage_of,
        stage_k,
        stage_v,
        block_tables,
        context_lens,
        part_out,
        part_lse,
        float(scale) * 1.4426950408889634,  # log2(e)
        *q.stride()[:2],
        *kq.stride()[:3],
        *kmin.stride()[:2],
        *vscale.stride()[:2],
        *stage_k.stride()[:3],
        block_tables.stride(0),
        *part_out.stride()[:3],
        *lse_strides,
        GROUP=group,
        G_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_SIZE=block_size,
        BITS=bits,
        NUM_SPLITS=num_splits,
        STORE_LSE=num_splits > 1,
        # fp32 runs get exact fp32 dots; half-precision runs get tf32, finer than their own dtype
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if num_splits > 1:
        merge_splits(part_out, part_lse, out)
    return out


def _codes_reference(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., w] uint8 -> [..., d] codes as fp32 (int4: even channel from the low nibble)."""
    if bits == 8:
        return packed.float()
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2).float()


def _key_step_reference(kmin: torch.Tensor, kmax: torch.Tensor, bits: int) -> torch.Tensor:
    """kv_quant.key_scale: fp32 step, 1 where not > 0, rounded to fp16; returned as fp32."""
    step = (kmax.float() - kmin.float()) / ((1 << bits) - 1)
    return torch.where(step > 0, step, torch.ones_like(step)).half().float()


def paged_decode_quant_reference(
    q: torch.Tensor,
    kq: torch.Tensor,
    vq: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    vscale: torch.Tensor,
    vzero: torch.Tensor,
    stage_of: torch.Tensor,
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    bits: int,
) -> torch.Tensor:
    """The same attention in PyTorch, request by request: dequantize the request's blocks in fp32 as
    the engine does (staged blocks from staging), fp32 softmax. Returns [b, H, d] in q's dtype."""
    b, heads, d = q.shape
    kv_heads, _, bs, _ = kq.shape
    out = torch.zeros(b, heads, d, dtype=torch.float32, device=q.device)
    for row, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        blocks = block_tables[row, : -(-n // bs)].long()
        lo, hi = kmin[:, blocks], kmax[:, blocks]  # [h, nb, d]
        k = lo.float().unsqueeze(2) + _codes_reference(kq[:, blocks], bits) * _key_step_reference(
            lo, hi, bits
        ).unsqueeze(2)
        v = vzero[:, blocks].float().unsqueeze(-1) + _codes_reference(vq[:, blocks], bits) * vscale[
            :, blocks
        ].float().unsqueeze(-1)  # [h, nb, bs, d]
        slots = stage_of[blocks].long()
        staged = (slots >= 0).nonzero().squeeze(1)
        k[:, staged] = stage_k[:, slots[staged]].float()
        v[:, staged] = stage_v[:, slots[staged]].float()
        k, v = k.flatten(1, 2)[:, :n], v.flatten(1, 2)[:, :n]  # [h, n, d]
        qg = q[row].float().view(kv_heads, heads // kv_heads, d)
        p = torch.softmax(qg @ k.transpose(1, 2) * scale, dim=-1)  # [h, group, n]
        out[row] = (p @ v).reshape(heads, d)
    return out.to(q.dtype)


def decode_quant_bytes_read(
    context_lens: Sequence[int], num_kv_heads: int, head_dim: int, block_size: int, bits: int
) -> int:
    """Bytes of codes and scales one call reads (per layer): for every (request, KV head) and every
    block the context touches, bs * w bytes of key codes and as many of value codes, fp16 kmin / kmax
    per channel and fp16 vscale / vzero per token. Leaves out q, the output, block tables and the
    staging overlay (at most one full-precision block per request, read instead of its codes)."""
    blocks = sum(-(-n // block_size) for n in context_lens)
    width = head_dim if bits == 8 else head_dim // 2
    per_block = 2 * block_size * width + 2 * 2 * head_dim + 2 * 2 * block_size
    return blocks * num_kv_heads * per_block


def decode_dense_bytes_read(
    context_lens: Sequence[int], num_kv_heads: int, head_dim: int, block_size: int, element_size: int = 2
) -> int:
    """What a full-precision paged cache (bf16 by default) reads for the same call: whole blocks of
    keys and values; the "bytes vs bf16" baseline for `decode_quant_bytes_read`."""
    blocks = sum(-(-n // block_size) for n in context_lens)
    return blocks * num_kv_heads * 2 * block_size * head_dim * element_size
