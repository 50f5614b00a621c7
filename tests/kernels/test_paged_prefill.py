"""Paged prefill attention against its PyTorch reference and the engine's DenseAttention (under
TRITON_INTERPRET=1 on the CPU): shuffled block tables, partly filled last blocks, GQA, strided views."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cloud.engine.attention.dense import AttentionMetadata, DenseAttention, PrefillSeq
from cloud.engine.kv.cache import KVCache
from kernels.triton.paged_prefill import paged_prefill, paged_prefill_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (start_pos, chunk length): a first chunk; one starting mid-block, longer than a query tile, whose
# first token sits right before a key-tile edge (30 + 1 = 31: the unmasked tiles must stop at 16
# and 32 for BLOCK_N 16 and 32); an empty one; a short question after a long cached prefix
SEQS = [(0, 9), (30, 40), (5, 0), (150, 3)]


@dataclass
class Layout:
    q: torch.Tensor  # [T, H, d]
    k_cache: torch.Tensor  # [kv_heads, num_blocks, block_size, d]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [s, max_blocks], padded with -1
    cu_seqlens: torch.Tensor  # [s + 1]
    start_pos: torch.Tensor  # [s]
    max_q_len: int


def make_layout(
    seqs: list[tuple[int, int]],
    kv_heads: int,
    group: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    index_dtype: torch.dtype = torch.int32,
    seed: int = 0,
) -> Layout:
    """Random q and caches; every sequence's blocks drawn at random from a shuffled pool, so no table
    is consecutive. Slots outside every context hold NaN: reading one would poison the output. q and
    the caches are strided views (q a slice of a fused qkv tensor, the caches padded past d)."""
    g = torch.Generator().manual_seed(seed)
    used = [-(-(start + n) // block_size) for start, n in seqs]
    num_blocks = sum(used) + 3
    ids = torch.randperm(num_blocks, generator=g)
    max_blocks = max(used) + 1
    tables = torch.full((len(seqs), max_blocks), -1, dtype=index_dtype)
    k = torch.full((kv_heads, num_blocks, block_size, d + 16), float("nan"))
    v = torch.full_like(k, float("nan"))
    taken = 0
    for s, ((start, n), nb) in enumerate(zip(seqs, used, strict=True)):
        tables[s, :nb] = ids[taken : taken + nb].to(index_dtype)
        taken += nb
        pos = torch.arange(start + n)
        blocks, slots = tables[s].long()[pos // block_size], pos % block_size
        k[:, blocks, slots, :d] = torch.randn(kv_heads, start + n, d, generator=g)
        v[:, blocks, slots, :d] = torch.randn(kv_heads, start + n, d, generator=g)
    lens = torch.tensor([n for _, n in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=index_dtype)
    cu[1:] = lens.cumsum(0).to(index_dtype)
    heads = kv_heads * group
    qkv = torch.randn(int(lens.sum()), heads + 2 * kv_heads, d, generator=g)
    return Layout(
        q=qkv[:, :heads].to(DEVICE, dtype),
        k_cache=k.to(DEVICE, dtype)[..., :d],
        v_cache=v.to(DEVICE, dtype)[..., :d],
        block_tables=tables.to(DEVICE),
        cu_seqlens=cu.to(DEVICE),
        start_pos=torch.tensor([start for start, _ in seqs], dtype=index_dtype, device=DEVICE),
        max_q_len=int(lens.max()),
    )


def run(lay: Layout, scale: float) -> torch.Tensor:
    return paged_prefill(
        lay.q,
        lay.k_cache,
        lay.v_cache,
        lay.block_tables,
        lay.cu_seqlens,
        lay.start_pos,
        scale,
        max_q_len=lay.max_q_len,
    )


def reference(lay: Layout, scale: float) -> torch.Tensor:
    args = (lay.k_cache.float(), lay.v_cache.float(), lay.block_tables, lay.cu_seqlens, lay.start_pos)
    return paged_prefill_reference(lay.q.float(), *args, scale)


@pytest.mark.parametrize(
    ("group", "d", "block_size", "index_dtype"),
    [
        (1, 64, 16, torch.int32),
        (3, 128, 32, torch.int64),
        (8, 64, 32, torch.int32),
    ],
)
def test_fp32_matches_reference(group: int, d: int, block_size: int, index_dtype: torch.dtype) -> None:
    lay = make_layout(SEQS, 2, group, d, block_size, torch.float32, index_dtype, seed=group)
    assert lay.q.stride(0) != lay.q.shape[1] * d and lay.k_cache.stride(2) != d  # strided views
    out = run(lay, d**-0.5)
    assert out.shape == lay.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(lay, d**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "group", "d", "block_size"),
    [(torch.bfloat16, 8, 128, 16), (torch.float16, 3, 64, 32), (torch.bfloat16, 1, 64, 32)],
)
def test_half_precision_close_to_fp32(dtype: torch.dtype, group: int, d: int, block_size: int) -> None:
    lay = make_layout(SEQS, 2, group, d, block_size, dtype, seed=7)
    out = run(lay, d**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(lay, d**-0.5), atol=2e-2, rtol=0)


def test_max_q_len_may_exceed_the_longest_chunk_and_out_is_written() -> None:
    lay = make_layout([(3, 5), (40, 2)], 1, 3, 64, 16, torch.float32)
    out = torch.full_like(lay.q, float("nan"))
    args = (lay.q, lay.k_cache, lay.v_cache, lay.block_tables, lay.cu_seqlens, lay.start_pos, 0.1)
    assert paged_prefill(*args, max_q_len=40, out=out) is out
    torch.testing.assert_close(out, reference(lay, 0.1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_engine_dense_attention(block_size: int) -> None:
    """The engine's prefill path (prefix from the cache, the chunk from its fresh k / v, merged by
    log-sum-exp) over the same KVCache the kernel reads without a copy."""
    kvh, group, d = 2, 3, 64
    seqs = [(0, 7), (block_size + 5, 6), (70, 2)]
    g = torch.Generator().manual_seed(block_size)
    used = [-(-(start + n) // block_size) for start, n in seqs]
    num_blocks = sum(used) + 2
    ids = torch.randperm(num_blocks, generator=g)
    cache = KVCache(1, num_blocks, block_size, kvh, d, torch.float32)
    tables = torch.zeros(len(seqs), max(used), dtype=torch.int64)
    prefills, ks, vs, slots = [], [], [], []
    q_start = 0
    for s, ((start, n), nb) in enumerate(zip(seqs, used, strict=True)):
        tables[s, :nb] = ids[sum(used[:s]) : sum(used[:s]) + nb]
        pos = torch.arange(start + n)
        slot = tables[s][pos // block_size] * block_size + pos % block_size
        k_all, v_all = torch.randn(2, start + n, kvh, d, generator=g)
        cache.write(0, k_all, v_all, slot)
        ks.append(k_all[start:])
        vs.append(v_all[start:])
        slots.append(slot[start:])
        prefills.append(PrefillSeq(q_start=q_start, q_len=n, start_pos=start, block_table=tables[s, :nb]))
        q_start += n
    q = torch.randn(q_start, kvh * group, d, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), num_decode=0, decode_blocks=None, decode_mask=None, prefills=prefills
    )
    engine = DenseAttention(kvh * group, kvh, d)
    expected = engine(0, q, torch.cat(ks), torch.cat(vs), cache, meta)

    k_cache = cache.k[0].view(kvh, num_blocks, block_size, d).to(DEVICE)
    v_cache = cache.v[0].view(kvh, num_blocks, block_size, d).to(DEVICE)
    cu = torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    start_pos = torch.tensor([start for start, _ in seqs])
    out = paged_prefill(
        q.to(DEVICE),
        k_cache,
        v_cache,
        tables.to(DEVICE),
        cu.to(DEVICE),
        start_pos.to(DEVICE),
        engine.scale,
        max_q_len=7,
    )
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def _bad(lay: Layout, **change: object) -> dict[str, object]:
    args: dict[str, object] = {
        "q": lay.q,
        "k_cache": lay.k_cache,
        "v_cache": lay.v_cache,
        "block_tables": lay.block_tables,
        "cu_seqlens_q": lay.cu_seqlens,
        "start_pos": lay.start_pos,
        "scale": 0.125,
        "max_q_len": lay.max_q_len,
    }
    args.update(change)
    return args


def test_refuses_bad_input() -> None:
    lay = make_layout([(0, 4), (20, 3)], 2, 2, 64, 16, torch.float32)
    T, H, d = lay.q.shape
    cases: list[tuple[str, dict[str, object]]] = [
        ("wants q", _bad(lay, q=lay.q[0])),
        ("shape mismatch", _bad(lay, v_cache=lay.v_cache[:1])),
        ("shape mismatch", _bad(lay, q=lay.q[:, :3])),  # 3 heads over 2 KV heads
        ("shape mismatch", _bad(lay, start_pos=lay.start_pos[:1])),
        (
            "head_dim",
            _bad(lay, q=lay.q[..., :32], k_cache=lay.k_cache[..., :32], v_cache=lay.v_cache[..., :32]),
        ),
        ("fp32/fp16/bf16", _bad(lay, q=lay.q.double())),
        ("caches alike", _bad(lay, v_cache=lay.v_cache.half())),
        ("int32 or int64", _bad(lay, block_tables=lay.block_tables.float())),
        ("contiguous last", _bad(lay, q=torch.randn(T, H, 2 * d, device=DEVICE)[..., ::2])),
        ("max_q_len", _bad(lay, max_q_len=-1)),
        ("scale", _bad(lay, scale=float("nan"))),
        ("out must be", {**_bad(lay), "out": torch.empty(T, H, d, dtype=torch.float16, device=DEVICE)}),
        ("one device", _bad(lay, start_pos=lay.start_pos.to("meta"))),
    ]
    if DEVICE == "cpu":  # the values are checked where that needs no host sync
        cases += [
            ("longer than max_q_len", _bad(lay, max_q_len=3)),
            ("rise from 0", _bad(lay, cu_seqlens_q=lay.cu_seqlens.flip(0))),
            ("not be negative", _bad(lay, start_pos=-lay.start_pos - 1)),
            ("do not cover", _bad(lay, start_pos=lay.start_pos + 1000)),
            ("block ids", _bad(lay, block_tables=lay.block_tables.clamp(min=0) + 100)),
        ]
    for match, kwargs in cases:
        with pytest.raises(ValueError, match=match):
            paged_prefill(**kwargs)  # type: ignore[arg-type]
