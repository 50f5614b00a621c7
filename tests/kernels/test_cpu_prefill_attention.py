"""The C++ causal prefill attention (kernels/cpu/prefill_attention.cpp, `prefill_attention_cpu`)
against a float64 reference and the engine's own PyTorch prefill (DenseAttention.prefill), on every
ISA this CPU runs; and in the engine's CPU backend, which routes chunks to it."""

from __future__ import annotations

import math

import pytest
import torch

from cloud.engine.attention.cpu import CpuKernelAttention
from cloud.engine.attention.dense import AttentionMetadata, DenseAttention, PrefillSeq
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.quantized_cache import QuantizedKVCache
from kernels.cpu import paged_attention as pa

pytestmark = pytest.mark.skipif(not pa.available(), reason="the C++ extension cannot be built here")
ISAS = list(pa.Isa)


def _isa(isa: pa.Isa) -> pa.Isa:
    if isa not in pa.supported_isas():
        pytest.skip(f"this CPU does not run {isa.name}")
    return isa


def _cache(
    length: int, kv_heads: int, d: int, bs: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [kv_heads, num_blocks, bs, d] holding positions 0..length-1 in shuffled blocks, every
    other slot NaN (a read past the context would poison the output); the table [blocks + 2] int32."""
    need = -(-length // bs)
    num_blocks = need + 4
    table = torch.randperm(num_blocks, generator=gen)[: need + 2].to(torch.int32)
    k = torch.full((kv_heads, num_blocks, bs, d), float("nan"))
    v = torch.full_like(k, float("nan"))
    for cache in (k, v):
        rows = torch.full((kv_heads, need * bs, d), float("nan"))
        rows[:, :length] = torch.randn(kv_heads, length, d, generator=gen)
        cache[:, table[:need].long()] = rows.view(kv_heads, need, bs, d)
    return k, v, table


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v with query t seeing keys 0..start + t."""
    n, heads, d = q.shape
    kv_heads, _, bs, _ = k.shape
    length = start + n
    blocks = table[: -(-length // bs)].long()
    keys = k[:, blocks].reshape(kv_heads, -1, d)[:, :length].double().repeat_interleave(heads // kv_heads, 0)
    vals = v[:, blocks].reshape(kv_heads, -1, d)[:, :length].double().repeat_interleave(heads // kv_heads, 0)
    s = torch.einsum("nhd,hkd->hnk", q.double(), keys) * scale
    after = torch.arange(length)[None, :] > (start + torch.arange(n))[:, None]
    p = s.masked_fill(after, -math.inf).softmax(-1)
    return torch.einsum("hnk,hkd->nhd", p, vals).float()


CASES = [  # n, start, heads, kv_heads, d, block_size
    (1, 0, 9, 3, 64, 16),  # one token, one key
    (5, 0, 9, 3, 64, 16),
    (37, 0, 9, 3, 64, 16),  # rows not a whole vector
    (100, 200, 9, 3, 64, 16),  # a chunk after a cached prefix
    (1, 130, 9, 3, 64, 16),  # one new token after 130
    (70, 33, 4, 4, 128, 8),  # no GQA; the prefix ends mid-block
    (130, 0, 8, 2, 64, 32),
    (17, 90, 1, 1, 256, 16),
    (60, 70, 10, 2, 64, 16),  # group 5: 45 rows an item
]


@pytest.mark.parametrize("isa", ISAS, ids=[i.name for i in ISAS])
@pytest.mark.parametrize(("n", "start", "heads", "kv_heads", "d", "bs"), CASES)
def test_matches_the_float64_reference(
    isa: pa.Isa, n: int, start: int, heads: int, kv_heads: int, d: int, bs: int
) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + start)
    k, v, table = _cache(start + n, kv_heads, d, bs, gen)
    q = torch.randn(n, heads, d, generator=gen)
    got = pa.prefill_attention_cpu(q, k, v, table, start, d**-0.5, isa=_isa(isa))
    torch.testing.assert_close(got, _reference(q, k, v, table, start, d**-0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS, ids=[i.name for i in ISAS])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("n", "start"), [(1, 700), (4, 1000), (4, 1023), (16, 640), (2, 64)])
def test_a_short_chunk_after_a_long_context_is_split_over_its_keys(
    isa: pa.Isa, threads: int, n: int, start: int
) -> None:
    """A verify step's chunk (1 + drafts positions) makes one item per KV head; with 2+ threads each
    is cut into parts over its keys and merged (a cut never lies past what row 0 sees: start 1023
    puts the first row one key before a tile's end, start 64 leaves one whole tile to cut)."""
    gen = torch.Generator().manual_seed(n * 7 + start + threads)
    k, v, table = _cache(start + n, 3, 64, 16, gen)
    q = torch.randn(n, 9, 64, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = pa.prefill_attention_cpu(q, k, v, table, start, 0.125, isa=_isa(isa))
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, _reference(q, k, v, table, start, 0.125), atol=2e-6, rtol=1e-5)


def test_strided_queries_and_output_in_place() -> None:
    gen = torch.Generator().manual_seed(3)
    k, v, table = _cache(90, 3, 64, 16, gen)
    qkv = torch.randn(40, 15, 64, generator=gen)  # q is the first 9 heads of a fused projection
    q = qkv[:, :9]
    out = torch.full((50, 9, 64), 7.0)
    got = pa.prefill_attention_cpu(q, k, v, table, 50, 0.125, out=out[5:45])
    assert got.data_ptr() == out[5:45].data_ptr()
    torch.testing.assert_close(out[5:45], _reference(q, k, v, table, 50, 0.125), atol=2e-6, rtol=1e-5)
    assert bool((out[:5] == 7).all() and (out[45:] == 7).all())


def test_equals_the_engine_prefill_on_a_real_kv_cache() -> None:
    """Chunks of 48 tokens after 0, 48 and 96 cached ones, written by the engine's KVCache."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d, bs, total = 9, 3, 64, 16, 130
    cache = KVCache(1, 20, bs, kv_heads, d, torch.float32)
    table = torch.randperm(20, generator=gen)[: -(-total // bs)]
    q = torch.randn(total, heads, d, generator=gen)
    k = torch.randn(total, kv_heads, d, generator=gen)
    v = torch.randn(total, kv_heads, d, generator=gen)
    pos = torch.arange(total)
    cache.write(0, k, v, table[pos // bs] * bs + pos % bs)
    dense = DenseAttention(heads, kv_heads, d)
    kc, vc = cache.blocks_view(0)
    for start in (0, 48, 96):
        rows = slice(start, min(total, start + 48))
        seq = PrefillSeq(0, rows.stop - start, start, table[: -(-rows.stop // bs)])
        want = dense.prefill(0, q[rows], k[rows], v[rows], cache, seq)
        got = pa.prefill_attention_cpu(q[rows], kc, vc, seq.block_table, start, dense.scale)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _meta(seqs: list[PrefillSeq], slots: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=slots, num_decode=0, decode_blocks=None, decode_mask=None, prefills=seqs
    )


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_the_cpu_backend_gives_the_reference_output(kind: str) -> None:
    """Three requests' chunks in one step: the fp32 cache takes the kernels (the prefill kernel for
    the long chunks, the multi-query decode kernel for 3 positions after 33 cached, a verify step's
    shape), the int8 one the reference (whose chunk keys stay unrounded); all equal DenseAttention."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    if kind == "fp32":
        cache: KVCache | QuantizedKVCache = KVCache(1, 16, bs, kv_heads, d, torch.float32)
    else:
        cache = QuantizedKVCache(1, 16, bs, kv_heads, d, torch.float32, 8, lambda _: False, staging_slots=2)
    tables = [torch.arange(0, 6), torch.arange(8, 12), torch.tensor([15, 13, 6])]
    # request 0 has 40 cached tokens and prefills 50 more; request 1 prefills its first 20;
    # request 2 has 33 cached and checks 3 positions
    for table, n in ((tables[0], 40), (tables[2], 33)):
        cached = torch.arange(n)
        kv = torch.randn(2, n, kv_heads, d, generator=gen)
        cache.write(0, kv[0], kv[1], table[cached // bs] * bs + cached % bs)
    seqs = [
        PrefillSeq(0, 50, 40, tables[0]),
        PrefillSeq(50, 20, 0, tables[1]),
        PrefillSeq(70, 3, 33, tables[2]),
    ]
    positions = (torch.arange(40, 90), torch.arange(0, 20), torch.arange(33, 36))
    slots = torch.cat([t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)])
    q = torch.randn(73, heads, d, generator=gen)
    k = torch.randn(73, kv_heads, d, generator=gen)
    v = torch.randn(73, kv_heads, d, generator=gen)
    cache.write(0, k, v, slots)
    dense = DenseAttention(heads, kv_heads, d)
    want = dense(0, q, k, v, cache, _meta(seqs, slots))
    got = CpuKernelAttention(dense)(0, q, k, v, cache, _meta(seqs, slots))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _bad(case: str) -> None:
    k = torch.zeros(3, 8, 16, 64)
    q = torch.zeros(20, 9, 64)
    table = torch.arange(8, dtype=torch.int32)
    args: dict[str, object] = {"q": q, "k_cache": k, "v_cache": k.clone(), "block_table": table, "start": 0}
    if case == "short table":
        args["block_table"] = table[:1]
        args["start"] = 10
    elif case == "block out of range":
        args["block_table"] = torch.tensor([0, 99, 1], dtype=torch.int32)
        args["start"] = 16
    elif case == "negative block":
        args["block_table"] = torch.tensor([1, -1], dtype=torch.int32)
    elif case == "bf16 cache":
        args["k_cache"], args["v_cache"] = k.bfloat16(), k.bfloat16()
    elif case == "bf16 q":
        args["q"] = q.bfloat16()
    elif case == "head dims":
        args["q"] = torch.zeros(20, 9, 32)
    elif case == "heads":
        args["q"] = torch.zeros(20, 8, 64)
    elif case == "negative start":
        args["start"] = -1
    elif case == "float table":
        args["block_table"] = table.float()
    elif case == "out shape":
        pa.prefill_attention_cpu(q, k, k, table, 0, 0.125, out=torch.zeros(20, 9, 32))
    elif case == "head dim 12":
        args["q"], args["k_cache"], args["v_cache"] = (
            torch.zeros(2, 3, 12),
            torch.zeros(3, 8, 16, 12),
            torch.zeros(3, 8, 16, 12),
        )
    pa.prefill_attention_cpu(scale=0.125, **args)  # type: ignore[arg-type]


BAD = {
    "short table": "table has 1 blocks; positions 0..29 need 2",
    "block out of range": "block 99, outside",
    "negative block": "block -1, outside",
    "bf16 cache": "fp32 cache",
    "bf16 q": "q has dtype",
    "head dims": "head dims differ",
    "heads": "not a multiple of 3 KV heads",
    "negative start": "start must be",
    "float table": "block_table has dtype",
    "out shape": "out has shape",
    "head dim 12": "head dim 12 is not supported",
}


@pytest.mark.parametrize("case", list(BAD))
def test_refuses_bad_input(case: str) -> None:
    with pytest.raises(ValueError, match=BAD[case]):
        _bad(case)


def test_an_empty_chunk_gives_an_empty_output() -> None:
    k = torch.zeros(1, 2, 16, 64)
    out = pa.prefill_attention_cpu(torch.zeros(0, 2, 64), k, k, torch.zeros(0, dtype=torch.int64), 5, 0.125)
    assert tuple(out.shape) == (0, 2, 64)
