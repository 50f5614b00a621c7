"""The fused CPU decode attention (kernels/cpu/paged_attention.py) against its PyTorch references, on
every vector path this CPU runs (AVX-512, AVX2, plain C++), and against the engine's own decode on
a real KVCache and a real QuantizedKVCache filled through their own writes.

Layouts are adversarial: shuffled, non-consecutive block ids, partly filled last blocks, lengths 0
and 1, caches with unusual strides, and every slot the kernel must not read (unused blocks, the tail
of each last block, the block the table's padding names) set to NaN.

Tolerances: the kernels do the references' fp32 math in another order, so fp32 outputs agree to
1e-5 (dense, sparse; the quantized cache's outlier-channel keys: atol 2e-5, rtol 1e-4, as its GPU
kernel); a bf16 output may differ by one bf16 rounding (1e-2). Against the engine's decode
(SDPA over a dequantized copy): 1e-4.

`bench()` (run this file as a script) times the engine's PyTorch decode against the kernels. It
lives here, not beside the kernels, because it drives the engine's caches and kernels/ may import
nothing of ours.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from cloud.engine.attention.dense import AttentionMetadata, DenseAttention
from cloud.engine.attention.sparse import SparseAttention
from cloud.engine.config import SparseConfig
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.quantized_cache import QuantizedKVCache
from kernels.cpu import paged_attention as pa
from kernels.triton.paged_decode import paged_decode_reference
from kernels.triton.paged_decode_quant import paged_decode_quant_reference
from kernels.triton.sparse_decode import sparse_paged_decode_reference

pytestmark = pytest.mark.skipif(not pa.available(), reason="the C++ extension cannot be built here")
ISAS = list(pa.Isa)
BF16 = torch.bfloat16


def _isa(isa: pa.Isa) -> pa.Isa:
    if isa not in pa.supported_isas():
        pytest.skip(f"this CPU does not run {isa.name}")
    return isa


def _close(
    out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, atol: float = 1e-5, rtol: float = 1e-5
) -> None:
    """fp32 outputs to (atol, rtol); a bf16 output to one bf16 rounding."""
    if dtype == BF16:
        atol = rtol = 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def _layout(
    lens: list[int], kv_heads: int, d: int, bs: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [kv_heads, num_blocks, bs, d] fp32 and a table [b, width] int64: each request's blocks
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


def _odd_strides(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k stored block-major [num_blocks, kv_heads, bs, d]; v with rows padded to 2d."""
    k_odd = k.transpose(0, 1).contiguous().transpose(0, 1)
    v_odd = torch.zeros(*v.shape[:3], 2 * v.shape[3], dtype=v.dtype)
    v_odd[..., : v.shape[3]] = v
    return k_odd, v_odd[..., : v.shape[3]]


# -- dense --------------------------------------------------------------------------------------

DENSE = [  # q dtype, cache dtype, group, d, block_size, lens
    (torch.float32, torch.float32, 1, 64, 16, [97, 1, 0]),
    (torch.float32, torch.float32, 3, 128, 32, [64, 0, 33]),
    (torch.float32, torch.float32, 8, 64, 16, [1, 80, 0]),
    (torch.float32, BF16, 3, 64, 32, [90, 1]),
    (torch.float32, torch.float16, 3, 128, 16, [70, 0, 1]),
    (BF16, BF16, 8, 128, 16, [100, 1, 0]),
    (BF16, torch.float32, 1, 64, 32, [48, 17]),
]


@pytest.mark.parametrize("isa", ISAS, ids=[i.name for i in ISAS])
@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype", "group", "d", "bs", "lens"),
    DENSE,
    ids=[f"{str(c[0])[6:]}-{str(c[1])[6:]}-g{c[2]}-d{c[3]}-bs{c[4]}" for c in DENSE],
)
def test_dense_matches_reference(
    isa: pa.Isa,
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    group: int,
    d: int,
    bs: int,
    lens: list[int],
) -> None:
    gen = torch.Generator().manual_seed(group * 1000 + d + bs)
    kv_heads = 2
    k, v, table = _layout(lens, kv_heads, d, bs, gen)
    k, v = _odd_strides(k.to(cache_dtype), v.to(cache_dtype))
    q = torch.randn(len(lens), kv_heads * group, 2 * d, generator=gen).to(q_dtype)[..., :d]
    table = table.to(torch.int32 if d == 64 else torch.int64)
    ctx = torch.tensor(lens, dtype=torch.int64 if bs == 16 else torch.int32)

    out = pa.paged_decode_cpu(q, k, v, table, ctx, d**-0.5, isa=_isa(isa))
    ref = paged_decode_reference(q, k, v, table, ctx, d**-0.5)
    assert out.dtype == q_dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    _close(out, ref, q_dtype)
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.count_nonzero(out[i]) == 0


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_contexts_agree_with_one_pass(threads: int) -> None:
    """Long contexts at batch 1 are cut into splits merged by log-sum-exp (flash-decoding) when
    threads > 1; the result is the reference's whichever way the work is cut."""
    gen = torch.Generator().manual_seed(threads)
    lens, kv_heads, d, bs = [2000, 700], 1, 64, 16
    k, v, table = _layout(lens, kv_heads, d, bs, gen)
    q = torch.randn(2, 3, d, generator=gen)
    ctx = torch.tensor(lens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = pa.paged_decode_cpu(q, k, v, table, ctx, d**-0.5)
    finally:
        torch.set_num_threads(before)
    _close(out, paged_decode_reference(q, k, v, table, ctx, d**-0.5), torch.float32)


def test_clamps_lengths_to_the_table() -> None:
    """A context longer than the table reads the table's blocks only, as the reference does."""
    gen = torch.Generator().manual_seed(3)
    k, v, table = _layout([64], 1, 64, 16, gen)
    table = table[:, :4]  # exactly the 4 live blocks
    q = torch.randn(1, 2, 64, generator=gen)
    long, neg = torch.tensor([1000]), torch.tensor([-5])
    want = paged_decode_reference(q, k, v, table, torch.tensor([64]), 0.125)
    _close(pa.paged_decode_cpu(q, k, v, table, long, 0.125), want, torch.float32)
    assert torch.count_nonzero(pa.paged_decode_cpu(q, k, v, table, neg, 0.125)) == 0


def _engine_tables(lens: list[int], num_blocks: int, bs: int, gen: torch.Generator) -> torch.Tensor:
    """Tables of shuffled block ids. Padding names the first request's first block: the engine's
    masked gather reads padding (it pads with block 0) and needs finite values there."""
    ids = torch.randperm(num_blocks, generator=gen)
    width = max(-(-n // bs) for n in lens)
    tables = torch.full((len(lens), width), int(ids[0]), dtype=torch.int64)
    at = 0
    for i, n in enumerate(lens):
        m = -(-n // bs)
        tables[i, :m] = ids[at : at + m]
        at += m
    return tables


def _slots(tables: torch.Tensor, row: int, positions: range, bs: int) -> torch.Tensor:
    pos = torch.tensor(list(positions), dtype=torch.int64)
    return tables[row, pos // bs] * bs + pos % bs


def _mask(lens: list[int], width: int) -> torch.Tensor:
    ctx = torch.tensor(lens)
    return (torch.arange(width) < ctx[:, None]).view(len(lens), 1, 1, width)


def test_equals_engine_dense_decode_on_a_real_kv_cache() -> None:
    gen = torch.Generator().manual_seed(7)
    kv_heads, group, d, bs, num_blocks = 3, 3, 64, 16, 20
    lens = [45, 1, 130]
    cache = KVCache(1, num_blocks, bs, kv_heads, d, torch.float32)
    tables = _engine_tables(lens, num_blocks, bs, gen)
    for i, n in enumerate(lens):
        slots = _slots(tables, i, range(n), bs)
        kv = torch.randn(2, n, kv_heads, d, generator=gen)
        cache.write(0, kv[0], kv[1], slots)
    q = torch.randn(len(lens), kv_heads * group, d, generator=gen)
    mask = _mask(lens, tables.shape[1] * bs)

    want = DenseAttention(kv_heads * group, kv_heads, d).decode(0, q, cache, tables, mask)
    got = pa.paged_decode_cpu(q, *cache.blocks_view(0), tables, torch.tensor(lens), d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- quantized ----------------------------------------------------------------------------------


def _quant_cache(
    bits: int, kv_heads: int, d: int, bs: int, dtype: torch.dtype, lens: list[int], seed: int
) -> tuple[QuantizedKVCache, torch.Tensor]:
    """A one-layer QuantizedKVCache holding `lens` tokens in shuffled blocks, written as a prefill
    step (all but the last token) and a decode step, so whole blocks are quantized (some finished
    from staging) and partly filled last blocks stay staged."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 2 * sum(-(-n // bs) for n in lens) + 3
    cache = QuantizedKVCache(1, num_blocks, bs, kv_heads, d, dtype, bits, lambda _: False, staging_slots=2)
    tables = _engine_tables(lens, num_blocks, bs, gen)
    steps = [[(r, p) for r, n in enumerate(lens) for p in range(n - 1)]]
    steps.append([(r, n - 1) for r, n in enumerate(lens) if n])
    for pos in steps:
        if not pos:
            continue
        slots = torch.cat([_slots(tables, r, range(p, p + 1), bs) for r, p in pos])
        k = torch.randn(len(pos), kv_heads, d, generator=gen) * 2
        k[:, :, 3] += 6  # an outlier channel, as real keys have
        v = torch.randn(len(pos), kv_heads, d, generator=gen)
        cache.begin_step(slots)
        cache.write(0, k.to(dtype), v.to(dtype), slots)
    return cache, tables


def _quant_inputs(cache: QuantizedKVCache, layer: int = 0) -> list[Any]:
    kmin, kmax = cache.key_bounds(layer)
    return [
        cache.kq[layer],
        cache.vq[layer],
        kmin,
        kmax,
        cache.vscale[layer],
        cache.vzero[layer],
        cache.stage_of,
        cache.stage_k[layer],
        cache.stage_v[layer],
    ]


QUANT = [  # bits, group, d, cache dtype, block_size, lens
    (8, 1, 64, torch.float32, 16, [37, 0, 48]),
    (4, 3, 64, torch.float32, 32, [70, 1, 96]),
    (8, 3, 128, BF16, 32, [33, 64]),
    (4, 8, 128, torch.float32, 16, [1, 17, 29]),
    (4, 3, 64, BF16, 16, [50, 0, 32]),
]


@pytest.mark.parametrize("isa", ISAS, ids=[i.name for i in ISAS])
@pytest.mark.parametrize(
    ("bits", "group", "d", "dtype", "bs", "lens"),
    QUANT,
    ids=[f"int{c[0]}-g{c[1]}-d{c[2]}-{str(c[3])[6:]}-bs{c[4]}" for c in QUANT],
)
def test_quantized_matches_reference_and_engine(
    isa: pa.Isa, bits: int, group: int, d: int, dtype: torch.dtype, bs: int, lens: list[int]
) -> None:
    kv_heads = 3
    cache, tables = _quant_cache(bits, kv_heads, d, bs, dtype, lens, seed=bits * d + group + bs)
    used = torch.cat([tables[r, : -(-n // bs)] for r, n in enumerate(lens)])
    staged = cache.stage_of[used] >= 0
    assert bool(staged.any()) and not bool(staged.all())  # both sources are read
    q = torch.randn(len(lens), kv_heads * group, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    args: list[Any] = [q, *_quant_inputs(cache), tables, ctx, d**-0.5, bits]

    out = pa.paged_decode_quant_cpu(*args, isa=_isa(isa))
    assert out.dtype == dtype and out.shape == q.shape
    _close(out, paged_decode_quant_reference(*args), dtype, atol=2e-5, rtol=1e-4)
    live = ctx > 0
    assert torch.count_nonzero(out[~live]) == 0 and torch.isfinite(out).all()
    if dtype == torch.float32:  # the engine dequantizes in the run dtype: compare in fp32 only
        mask = _mask(lens, tables.shape[1] * bs)
        engine = DenseAttention(kv_heads * group, kv_heads, d).decode(0, q, cache, tables, mask)
        torch.testing.assert_close(out[live], engine[live], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_sparse_over_a_quantized_cache_reads_only_the_selected_blocks(bits: int) -> None:
    """Each head's selection (the row's last block, partly filled and staged, always among them) gives
    what dense attention over a table of just those blocks gives."""
    kv_heads, group, d, bs, lens = 3, 3, 64, 16, [150, 70]
    cache, tables = _quant_cache(bits, kv_heads, d, bs, torch.float32, lens, seed=bits + 40)
    gen = torch.Generator().manual_seed(bits)
    q = torch.randn(len(lens), kv_heads * group, d, generator=gen)
    width = 5
    selected = torch.full((len(lens), kv_heads, width), -1, dtype=torch.int32)
    picks: dict[tuple[int, int], list[int]] = {}
    for r, n in enumerate(lens):
        last = -(-n // bs) - 1
        for h in range(kv_heads):
            chosen = [*sorted(torch.randperm(last, generator=gen)[: width - 1 - h].tolist()), last]
            picks[r, h] = chosen
            selected[r, h, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    inputs = _quant_inputs(cache)
    ctx = torch.tensor(lens)
    out = pa.paged_decode_quant_cpu(q, *inputs, tables, ctx, d**-0.5, bits, selected=selected)
    for (r, h), chosen in picks.items():
        table = tables[r, chosen][None]
        n = (len(chosen) - 1) * bs + lens[r] - chosen[-1] * bs
        want = paged_decode_quant_reference(q[r : r + 1], *inputs, table, torch.tensor([n]), d**-0.5, bits)
        rows = slice(h * group, (h + 1) * group)
        torch.testing.assert_close(out[r, rows], want[0, rows], atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="selected"):
        pa.paged_decode_quant_cpu(q, *inputs, tables, ctx, d**-0.5, bits, selected=selected[:, :2])


# -- sparse -------------------------------------------------------------------------------------


def _sparse_case(seed: int, d: int = 64, group: int = 3) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    lens, kv_heads = [150, 1, 0, 64], 3
    k, v, table = _layout(lens, kv_heads, d, 16, gen)
    q = torch.randn(len(lens), kv_heads * group, d, generator=gen)
    return q, k, v, table, torch.tensor(lens)


@pytest.mark.parametrize("isa", ISAS, ids=[i.name for i in ISAS])
def test_sparse_matches_reference(isa: pa.Isa) -> None:
    """Random lists with -1, positions past the table and past the context, and duplicates (which
    count twice, as in the reference)."""
    q, k, v, table, ctx = _sparse_case(seed=5)
    gen = torch.Generator().manual_seed(6)
    sel = torch.randint(-1, table.shape[1] + 2, (4, 3, 9), generator=gen).to(torch.int32)
    sel[0, 0, :3] = torch.tensor([2, 2, 5])
    out = pa.sparse_paged_decode_cpu(q, k, v, table, sel, ctx, 0.125, isa=_isa(isa))
    _close(out, sparse_paged_decode_reference(q, k, v, table, sel, ctx, 0.125), torch.float32)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_sparse_over_every_block_is_dense(dtype: torch.dtype) -> None:
    q, k, v, table, ctx = _sparse_case(seed=8, d=128, group=1)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    every = torch.arange(table.shape[1]).expand(4, 3, -1).contiguous()
    out = pa.sparse_paged_decode_cpu(q, k, v, table, every, ctx, 0.1)
    _close(out, paged_decode_reference(q, k, v, table, ctx, 0.1), dtype)


def test_sparse_with_nothing_selected_is_zero() -> None:
    q, k, v, table, ctx = _sparse_case(seed=9)
    for sel in (torch.empty(4, 3, 0, dtype=torch.int64), torch.full((4, 3, 5), -1)):
        out = pa.sparse_paged_decode_cpu(q, k, v, table, sel, ctx, 0.125)
        assert out.shape == q.shape and torch.count_nonzero(out) == 0


# -- refused input ------------------------------------------------------------------------------


def _dense_args() -> dict[str, Any]:
    return {
        "q": torch.zeros(2, 4, 64),
        "k_cache": torch.zeros(2, 5, 16, 64),
        "v_cache": torch.zeros(2, 5, 16, 64),
        "block_tables": torch.zeros(2, 3, dtype=torch.int32),
        "context_lens": torch.ones(2, dtype=torch.int32),
        "scale": 0.125,
    }


BAD_DENSE: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "q_2d": (lambda a: a.update(q=torch.zeros(2, 64)), "3 dimensions"),
    "head_dim_96": (
        lambda a: a.update(
            q=torch.zeros(2, 4, 96), k_cache=torch.zeros(2, 5, 16, 96), v_cache=torch.zeros(2, 5, 16, 96)
        ),
        "head dim 96",
    ),
    "d_mismatch": (lambda a: a.update(q=torch.zeros(2, 4, 128)), "head dims differ"),
    "heads_not_multiple": (lambda a: a.update(q=torch.zeros(2, 3, 64)), "not a multiple"),
    "v_shape": (lambda a: a.update(v_cache=torch.zeros(2, 6, 16, 64)), "v_cache has shape"),
    "q_float64": (lambda a: a.update(q=torch.zeros(2, 4, 64, dtype=torch.float64)), "q has dtype"),
    "cache_int8": (lambda a: a.update(k_cache=a["k_cache"].to(torch.int8)), "k_cache has dtype"),
    "strided_rows": (lambda a: a.update(v_cache=torch.zeros(2, 5, 16, 128)[..., ::2]), "contiguous"),
    "table_float": (lambda a: a.update(block_tables=torch.zeros(2, 3)), "block_tables has dtype"),
    "table_rows": (lambda a: a.update(block_tables=torch.zeros(3, 3, dtype=torch.int32)), "block_tables"),
    "lens_shape": (lambda a: a.update(context_lens=torch.ones(3, dtype=torch.int32)), "context_lens"),
    "scale_nan": (lambda a: a.update(scale=float("nan")), "finite"),
    "scale_tensor": (lambda a: a.update(scale=torch.tensor(0.1)), "scale"),
    "block_id_out_of_range": (lambda a: a.update(block_tables=torch.full((2, 3), 5)), "outside"),
    "negative_block_id": (lambda a: a.update(block_tables=torch.full((2, 3), -1)), "outside"),
}


@pytest.mark.parametrize("case", list(BAD_DENSE))
def test_dense_refuses_bad_input(case: str) -> None:
    args = _dense_args()
    change, message = BAD_DENSE[case]
    change(args)
    with pytest.raises(ValueError, match=message):
        pa.paged_decode_cpu(**args)


def test_sparse_refuses_bad_input() -> None:
    args = _dense_args()
    good = torch.zeros(2, 2, 3, dtype=torch.int32)
    for sel, message in ((good[:, :1], "selected"), (good.float(), "selected has dtype"), (good[0], "3 dim")):
        with pytest.raises(ValueError, match=message):
            pa.sparse_paged_decode_cpu(selected=sel, **args)
    args["block_tables"] = torch.tensor([[0, 9, 0], [0, 0, 0]], dtype=torch.int32)
    args["context_lens"] = torch.tensor([40, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside"):  # position 1 is live and names block 9
        pa.sparse_paged_decode_cpu(selected=torch.ones(2, 2, 1, dtype=torch.int32), **args)


def test_quantized_refuses_bad_input() -> None:
    cache, tables = _quant_cache(4, 1, 64, 16, torch.float32, [20], seed=2)
    q, ctx = torch.zeros(1, 2, 64), torch.tensor([20])
    inputs = _quant_inputs(cache)

    def call(*, at: int | None = None, value: Any = None, bits: int = 4, table: Any = tables) -> None:
        args = list(inputs)
        if at is not None:
            args[at] = value
        pa.paged_decode_quant_cpu(*[q, *args, table, ctx, 0.125, bits])

    with pytest.raises(ValueError, match="bits"):
        call(bits=3)
    with pytest.raises(ValueError, match="int8 vectors"):
        call(bits=8)
    with pytest.raises(ValueError, match="kmin has dtype"):
        call(at=2, value=inputs[2].float())
    with pytest.raises(ValueError, match="vscale has shape"):
        call(at=4, value=inputs[4][:, :-1])
    with pytest.raises(ValueError, match="stage_of"):
        call(at=6, value=inputs[6][:-1])
    with pytest.raises(ValueError, match="stage_v"):
        call(at=8, value=inputs[8][..., :32])
    with pytest.raises(ValueError, match="outside"):
        call(table=torch.full_like(tables, cache.num_blocks))
    stage_of = inputs[6].clone()
    stage_of[tables[0, 0]] = cache.num_staging_slots  # no such slot
    with pytest.raises(ValueError, match="staged in slot"):
        call(at=6, value=stage_of)


def test_unavailable_extension_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pa._EXT, "get", lambda: None)
    assert not pa.available()
    with pytest.raises(RuntimeError, match="could not be built"):
        pa.paged_decode_cpu(**_dense_args())


def test_empty_batch_and_forced_paths() -> None:
    args = _dense_args()
    args.update(q=torch.zeros(0, 4, 64), block_tables=torch.zeros(0, 3, dtype=torch.int32))
    args.update(context_lens=torch.zeros(0, dtype=torch.int32))
    assert pa.paged_decode_cpu(**args).shape == (0, 4, 64)
    isas = pa.supported_isas()
    assert isas[0] == pa.Isa.SCALAR and list(isas) == sorted(isas)
    with pytest.raises(ValueError, match="isa"):
        pa.paged_decode_cpu(**_dense_args(), isa=4)  # type: ignore[arg-type]


def test_bench_smoke() -> None:
    """The benchmark runs end to end (its timings are not checked: tests never assert time)."""
    rows = bench(contexts=(64,), batches=(1,), samples=1, selected_tokens=32)
    assert [r.kind for r in rows] == ["dense fp32", "sparse-32", "int8", "int4"]
    assert all(r.engine_ms > 0 and r.kernel_ms > 0 for r in rows)


# -- benchmark ----------------------------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
LAYER_BYTES = 256 << 20  # enough layers of cache that each timed call reads it cold, from DRAM


@dataclass(frozen=True, slots=True)
class BenchRow:
    kind: str  # dense fp32, sparse-N (N selected tokens), int8, int4
    context: int
    batch: int
    engine_ms: float  # the engine's PyTorch decode on its own cache
    kernel_ms: float
    kernel_gbps: float  # cache bytes the kernel reads per second


def _best_ms(fn: Callable[[int], object], samples: int) -> float:
    """Best wall time of one call fn(i), i = 1 .. samples (fn(0) warms up)."""
    fn(0)
    best = math.inf
    for i in range(1, samples + 1):
        start = time.perf_counter()
        fn(i)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _row(kind: str, ctx: int, batch: int, engine: float, kernel: float, read: float) -> BenchRow:
    return BenchRow(kind, ctx, batch, engine, kernel, read / kernel / 1e6)


def _filled(
    cache: KVCache | QuantizedKVCache, layers: int, tables: torch.Tensor, gen: torch.Generator
) -> None:
    """Every block of the tables written on every layer, through the cache's own writes."""
    bs = cache.block_size
    slots = (tables[:, :, None] * bs + torch.arange(bs)).reshape(-1)
    for layer in range(layers):
        k = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen)
        cache.begin_step(slots)
        cache.write(layer, k, torch.randn_like(k), slots)


def _bench_dense(ctx: int, batch: int, layers: int, samples: int, selected_tokens: int) -> list[BenchRow]:
    bs, gen, scale = 16, torch.Generator().manual_seed(0), HEAD_DIM**-0.5
    nb = ctx // bs
    cache = KVCache(layers, batch * nb, bs, KV_HEADS, HEAD_DIM, torch.float32, track_summaries=True)
    tables = torch.randperm(batch * nb, generator=gen).view(batch, nb)
    _filled(cache, layers, tables, gen)
    qs = [torch.randn(batch, HEADS, HEAD_DIM, generator=gen) for _ in range(8)]
    lens, mask = torch.full((batch,), ctx), _mask([ctx] * batch, ctx)
    dense = DenseAttention(HEADS, KV_HEADS, HEAD_DIM)
    engine = _best_ms(lambda i: dense.decode(i % layers, qs[i % 8], cache, tables, mask), samples)
    kernel = _best_ms(
        lambda i: pa.paged_decode_cpu(qs[i % 8], *cache.blocks_view(i % layers), tables, lens, scale),
        4 * samples,
    )
    rows = [_row("dense fp32", ctx, batch, engine, kernel, 2 * batch * ctx * KV_HEADS * HEAD_DIM * 4)]
    # sparse: the engine's defaults (64 sink, 256 window tokens) where they fit the budget
    sinks, window = min(64, selected_tokens // 16), min(256, selected_tokens // 4)
    config = SparseConfig(sinks=sinks, window=window, budget=selected_tokens, dense_layers=0)
    sparse = SparseAttention(dense, config, bs)
    meta = AttentionMetadata(tables[:, 0], batch, tables, mask, [], decode_lens=lens)
    engine = _best_ms(lambda i: sparse(i % layers, qs[i % 8], qs[i % 8], qs[i % 8], cache, meta), samples)
    # the kernel's lists: n random blocks each, sorted, 8 sets in turn (the blocks read change)
    n = selected_tokens // bs
    sels = [torch.rand(batch, KV_HEADS, nb, generator=gen).argsort(-1)[..., :n].sort(-1).values for _ in qs]
    kernel = _best_ms(
        lambda i: pa.sparse_paged_decode_cpu(
            qs[i % 8], *cache.blocks_view(i % layers), tables, sels[i % 8], lens, scale
        ),
        4 * samples,
    )
    read = 2 * batch * min(n * bs, ctx) * KV_HEADS * HEAD_DIM * 4
    return [*rows, _row(f"sparse-{selected_tokens}", ctx, batch, engine, kernel, read)]


def _bench_quant(ctx: int, batch: int, layers: int, samples: int, bits: int) -> BenchRow:
    bs, gen, scale = 32, torch.Generator().manual_seed(bits), HEAD_DIM**-0.5
    nb = max(1, ctx // bs)
    cache = QuantizedKVCache(layers, batch * nb, bs, KV_HEADS, HEAD_DIM, torch.float32, bits, lambda _: False)
    tables = torch.randperm(batch * nb, generator=gen).view(batch, nb)
    _filled(cache, layers, tables, gen)
    ctx = nb * bs
    q, lens, mask = torch.randn(batch, HEADS, HEAD_DIM), torch.full((batch,), ctx), _mask([ctx] * batch, ctx)
    dense = DenseAttention(HEADS, KV_HEADS, HEAD_DIM)
    engine = _best_ms(lambda i: dense.decode(i % layers, q, cache, tables, mask), samples)
    kernel = _best_ms(
        lambda i: pa.paged_decode_quant_cpu(
            *[q, *_quant_inputs(cache, i % layers), tables, lens, scale, bits]
        ),
        4 * samples,
    )
    per_token = KV_HEADS * (2 * HEAD_DIM * bits // 8 + 4 + 4 * HEAD_DIM / bs)  # codes, value and key params
    return _row(f"int{bits}", ctx, batch, engine, kernel, batch * ctx * per_token)


def bench(
    contexts: tuple[int, ...] = (1024, 8192, 32768),
    batches: tuple[int, ...] = (1, 8),
    samples: int = 5,
    selected_tokens: int = 1024,
) -> list[BenchRow]:
    """Decode attention of one layer, SmolLM2 shapes (9 heads, 3 KV heads, d 64; blocks of 16, 32
    for a quantized cache), fp32: the engine's PyTorch path (gather + SDPA, dequantizing whole
    blocks for int8 / int4; Quest selection + per-head gather + SDPA for sparse) against the
    kernels (sparse: attention over a given list of selected_tokens / 16 blocks, the selection not
    timed; 8 lists in turn). Each call reads the next of enough layers (and queries, lists) that
    the cache is cold, as in a real model; best of `samples` (4x as many for the kernels) at
    torch's thread count."""
    rows = []
    for ctx in contexts:
        for batch in batches:
            layers = max(1, min(32, LAYER_BYTES // (2 * batch * ctx * KV_HEADS * HEAD_DIM * 4)))
            rows += _bench_dense(ctx, batch, layers, samples, selected_tokens)
            rows += [_bench_quant(ctx, batch, layers, samples, bits) for bits in (8, 4)]
    return rows


if __name__ == "__main__":
    print(f"threads {torch.get_num_threads()}, vector path {pa.supported_isas()[-1].name}")
    print(f"{'kind':12} {'context':>8} {'batch':>5} {'engine ms':>10} {'kernel ms':>10} {'x':>6} {'GB/s':>6}")
    for r in bench():
        speedup = r.engine_ms / r.kernel_ms
        print(
            f"{r.kind:12} {r.context:8} {r.batch:5} {r.engine_ms:10.3f} {r.kernel_ms:10.3f} "
            f"{speedup:6.1f} {r.kernel_gbps:6.1f}",
            flush=True,
        )


def test_unchecked_calls_give_the_same_answer_and_stay_memory_safe() -> None:
    gen = torch.Generator().manual_seed(5)
    k, v, table = _layout([40, 7], 3, 64, 16, gen)
    q = torch.randn(2, 9, 64, generator=gen)
    ctx = torch.tensor([40, 7])
    checked = pa.paged_decode_cpu(q, k, v, table, ctx, 0.125)
    assert torch.equal(pa.paged_decode_cpu(q, k, v, table, ctx, 0.125, check=False), checked)
    bad = table.clone()
    bad[0, 1] = k.shape[1] + 5  # a live position naming a block past the cache
    with pytest.raises(ValueError, match="outside"):
        pa.paged_decode_cpu(q, k, v, bad, ctx, 0.125, check=False)
