"""Paged decode attention against its PyTorch reference and the engine's own decode path (under
TRITON_INTERPRET=1 on the CPU; the same tests run on a GPU).

Layouts are adversarial: shuffled, non-consecutive block ids, partly filled last blocks, a
zero-length padded row, caches with unusual strides, and every slot the kernel must not read
(unused blocks, the tail of each last block, the block the table's padding points at) set to NaN.

Tolerances: fp32 queries (fp32, bf16 or fp8 caches: exact products) 1e-5; fp16 queries 3e-3 and bf16
queries 1.6e-2 against the fp32 reference on the same rounded inputs (the output's own rounding,
plus tf32 probabilities on a GPU); fp8 caches against the reference given the same fp8 codes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cloud.engine.attention.dense import DenseAttention
from cloud.engine.kv.cache import KVCache
from kernels.triton.paged_decode import (
    decode_bytes_read,
    default_num_splits,
    paged_decode,
    paged_decode_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.6e-2}


def paged_layout(
    lens: list[int], kv_heads: int, d: int, bs: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 k, v [kv_heads, num_blocks, bs, d] and a table [b, width] int64: each request's blocks
    drawn from a shuffled pool, every slot outside the contexts NaN, padding -> a NaN block."""
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 3
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(lens), max(need) + 2), int(ids[-1]), dtype=torch.int64)
    k = torch.full((kv_heads, num_blocks, bs, d), float("nan"))
    v = torch.full_like(k, float("nan"))
    at = 0
    for i, (n, m) in enumerate(zip(lens, need, strict=True)):
        blocks = ids[at : at + m]
        at += m
        table[i, :m] = blocks
        for cache in (k, v):
            rows = torch.full((kv_heads, m * bs, d), float("nan"))
            rows[:, :n] = torch.randn(kv_heads, n, d, generator=gen)
            cache[:, blocks] = rows.view(kv_heads, m, bs, d)
    return k, v, table


def odd_strides(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k stored block-major [num_blocks, kv_heads, bs, d]; v with rows padded to 2d: both viewed
    as [kv_heads, num_blocks, bs, d]."""
    k_odd = k.transpose(0, 1).contiguous().transpose(0, 1)
    v_odd = torch.zeros(*v.shape[:3], 2 * v.shape[3], dtype=v.dtype, device=v.device)
    v_odd[..., : v.shape[3]] = v
    return k_odd, v_odd[..., : v.shape[3]]


CASES = [
    # q dtype, cache dtype, group, d, block_size, splits, lens
    (torch.float32, torch.float32, 1, 64, 16, 1, [97, 1, 0]),
    (torch.float32, torch.float32, 3, 128, 32, 3, [64, 0, 33]),
    (torch.float32, torch.float32, 8, 64, 16, 4, [1, 80, 0]),
    (torch.float32, torch.bfloat16, 3, 64, 64, 2, [90, 1]),
    (torch.float16, torch.float16, 3, 64, 32, 2, [70, 0, 1]),
    (torch.bfloat16, torch.bfloat16, 8, 128, 16, 1, [100, 1, 0]),
    (torch.bfloat16, torch.bfloat16, 1, 64, 16, None, [48, 17]),
    (torch.float32, FP8, 3, 64, 16, 2, [75, 1, 0]),
    (torch.bfloat16, FP8, 8, 128, 32, 3, [0, 96, 1]),
]


@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype", "group", "d", "bs", "splits", "lens"),
    CASES,
    ids=[f"{str(c[0])[6:]}-{str(c[1])[6:]}-g{c[2]}-d{c[3]}-bs{c[4]}-s{c[5]}" for c in CASES],
)
def test_matches_reference(
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    group: int,
    d: int,
    bs: int,
    splits: int | None,
    lens: list[int],
) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + d + bs)
    kv_heads = 2
    k, v, table = paged_layout(lens, kv_heads, d, bs, gen)
    scales: dict[str, torch.Tensor] = {}
    if cache_dtype == FP8:  # stored = x / scale, per KV head
        ks, vs = torch.tensor([0.37, 2.9]), torch.tensor([1.7, 0.21])
        k, v = k / ks.view(-1, 1, 1, 1), v / vs.view(-1, 1, 1, 1)
        scales = {"k_scale": ks.to(DEVICE), "v_scale": vs.to(DEVICE)}
    k, v = odd_strides(k.to(cache_dtype).to(DEVICE), v.to(cache_dtype).to(DEVICE))
    heads = kv_heads * group
    q = torch.randn(len(lens), heads, 2 * d, generator=gen).to(q_dtype).to(DEVICE)[..., :d]
    table = table.to(DEVICE, torch.int32 if d == 64 else torch.int64)
    ctx = torch.tensor(lens, device=DEVICE, dtype=torch.int64 if bs == 16 else torch.int32)

    out = paged_decode(q, k, v, table, ctx, d**-0.5, num_splits=splits, **scales)
    ref = paged_decode_reference(q.float(), k, v, table, ctx, d**-0.5, **scales)  # fp32 result

    assert out.dtype == q_dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    tol = TOL[q_dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.count_nonzero(out[i]) == 0


def test_equals_engine_dense_decode() -> None:
    """The kernel on the engine's own KVCache storage equals DenseAttention.decode."""
    gen = torch.Generator().manual_seed(7)
    kv_heads, group, d, bs, num_blocks = 2, 4, 64, 16, 12
    lens = [45, 1, 30]
    cache = KVCache(1, num_blocks, bs, kv_heads, d, torch.float32)
    ids = torch.randperm(num_blocks, generator=gen)
    nb = max(-(-n // bs) for n in lens)
    blocks = torch.zeros(len(lens), nb, dtype=torch.int64)  # padded with block 0, as the engine does
    at = 0
    for i, n in enumerate(lens):
        m = -(-n // bs)
        blocks[i, :m] = ids[at : at + m]
        at += m
        slots = blocks[i, torch.arange(n) // bs] * bs + torch.arange(n) % bs
        kv = torch.randn(2, n, kv_heads, d, generator=gen)
        cache.write(0, kv[0], kv[1], slots)
    cache.k[0], cache.v[0] = cache.k[0].to(DEVICE), cache.v[0].to(DEVICE)
    q = torch.randn(len(lens), kv_heads * group, d, generator=gen).to(DEVICE)
    ctx = torch.tensor(lens, device=DEVICE)
    blocks = blocks.to(DEVICE)
    mask = (torch.arange(nb * bs, device=DEVICE) < ctx[:, None]).view(len(lens), 1, 1, nb * bs)

    want = DenseAttention(kv_heads * group, kv_heads, d).decode(0, q, cache, blocks, mask)
    out = torch.full_like(q, float("nan"))
    got = paged_decode(
        q,
        cache.k[0].view(kv_heads, num_blocks, bs, d),
        cache.v[0].view(kv_heads, num_blocks, bs, d),
        blocks,
        ctx,
        d**-0.5,
        num_splits=2,
        out=out,
    )
    assert got is out
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_num_splits_and_bytes_helpers() -> None:
    cpu = torch.device("cpu")
    assert default_num_splits(4, 8, 100, 16, cpu) == 2
    assert default_num_splits(4, 8, 1, 16, cpu) == 1  # one tile: no point splitting
    assert default_num_splits(0, 8, 0, 16, cpu) == 1
    assert decode_bytes_read(100, 8, 128, torch.bfloat16) == 2 * 100 * 8 * 128 * 2
    assert decode_bytes_read(100, 8, 128, FP8) == 2 * 100 * 8 * 128


def _base() -> dict[str, Any]:
    return {
        "q": torch.zeros(2, 4, 64),
        "k_cache": torch.zeros(2, 5, 16, 64),
        "v_cache": torch.zeros(2, 5, 16, 64),
        "block_tables": torch.zeros(2, 3, dtype=torch.int32),
        "context_lens": torch.ones(2, dtype=torch.int32),
        "scale": 0.125,
    }


def _fp8(a: dict[str, Any], **scales: torch.Tensor) -> None:
    a["k_cache"], a["v_cache"] = a["k_cache"].to(FP8), a["v_cache"].to(FP8)
    a.update(scales)


def _head_dim_96(a: dict[str, Any]) -> None:
    a.update(q=torch.zeros(2, 4, 96), k_cache=torch.zeros(2, 5, 16, 96), v_cache=torch.zeros(2, 5, 16, 96))


META_LENS = torch.ones(2, dtype=torch.int32, device="meta")
BAD: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "q_2d": (lambda a: a.update(q=torch.zeros(2, 64)), "wants q"),
    "head_dim_96": (_head_dim_96, "head dim 96"),
    "d_mismatch": (lambda a: a.update(q=torch.zeros(2, 4, 128)), "head dims differ"),
    "heads_not_multiple": (lambda a: a.update(q=torch.zeros(2, 3, 64)), "not a multiple"),
    "v_shape": (lambda a: a.update(v_cache=torch.zeros(2, 6, 16, 64)), "differs from k_cache"),
    "q_float64": (lambda a: a.update(q=torch.zeros(2, 4, 64, dtype=torch.float64)), "q dtype"),
    "cache_int8": (lambda a: a.update(k_cache=a["k_cache"].to(torch.int8)), "cache dtypes"),
    "kv_dtypes_differ": (lambda a: a.update(v_cache=a["v_cache"].half()), "cache dtypes"),
    "fp8_no_scales": (_fp8, "needs k_scale"),
    "fp8_scale_shape": (
        lambda a: _fp8(a, k_scale=torch.ones(4), v_scale=torch.ones(2)),
        "k_scale must be fp32",
    ),
    "fp8_scale_dtype": (
        lambda a: _fp8(a, k_scale=torch.ones(2), v_scale=torch.ones(2).half()),
        "v_scale must be fp32",
    ),
    "scales_without_fp8": (lambda a: a.update(k_scale=torch.ones(2)), "fp8 cache only"),
    "table_float": (lambda a: a.update(block_tables=a["block_tables"].float()), "int32 or int64"),
    "lens_float": (lambda a: a.update(context_lens=a["context_lens"].float()), "int32 or int64"),
    "table_rows": (lambda a: a.update(block_tables=torch.zeros(3, 3, dtype=torch.int32)), "block_tables"),
    "lens_shape": (lambda a: a.update(context_lens=torch.ones(3, dtype=torch.int32)), "context_lens"),
    "k_last_dim_strided": (
        lambda a: a.update(k_cache=torch.zeros(2, 5, 64, 16).transpose(-1, -2)),
        "k_cache needs a contiguous",
    ),
    "other_device": (lambda a: a.update(context_lens=META_LENS), "one device"),
    "out_dtype": (lambda a: a.update(out=torch.zeros(2, 4, 64, dtype=torch.float16)), "out must be"),
    "zero_splits": (lambda a: a.update(num_splits=0), "num_splits"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_refuses_bad_input(case: str) -> None:
    change, match = BAD[case]
    args = _base()
    change(args)
    with pytest.raises(ValueError, match=match):
        paged_decode(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_follows_new_lengths() -> None:
    """No host sync: the call captures into a CUDA graph and a replay reads the new lengths."""
    gen = torch.Generator().manual_seed(3)
    k, v, table = paged_layout([100, 40], 2, 128, 16, gen)
    k, v = k.nan_to_num().bfloat16().cuda(), v.nan_to_num().bfloat16().cuda()
    table = table.cuda()
    q = torch.randn(2, 16, 128, generator=gen).bfloat16().cuda()
    ctx = torch.tensor([100, 40], device="cuda")
    out = torch.empty_like(q)
    paged_decode(q, k, v, table, ctx, 128**-0.5, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(q, k, v, table, ctx, 128**-0.5, out=out)
    ctx.copy_(torch.tensor([7, 33], device="cuda"))
    graph.replay()
    ref = paged_decode_reference(q.float(), k, v, table, ctx, 128**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=1.6e-2, rtol=1.6e-2)
