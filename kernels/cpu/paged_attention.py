"""Attention on the CPU read in place from the paged KV cache. Decode (paged_attention.cpp): one query
token per request against its context, threaded over (request, KV head, context split), or the
last n positions of each request at once (multi-query: a verify step's drafts). Prefill
(prefill_attention.cpp, `prefill_attention_cpu`): a chunk of queries causally against the cached
prefix and itself, threaded over (KV head, run of positions), reference DenseAttention.prefill.

Three decode entry points, each with the argument list of its PyTorch reference in kernels/triton/ and the
same math in fp32 (only the order of fp32 additions differs):
    paged_decode_cpu          dense cache            paged_decode.paged_decode_reference
    paged_decode_quant_cpu    int8 / int4 codes      paged_decode_quant.paged_decode_quant_reference
    sparse_paged_decode_cpu   selected blocks only   sparse_decode.sparse_paged_decode_reference
Per (request, KV head) the G query heads of the group share every key and value row read; the
softmax is online in fp32; int8 / int4 codes are dequantized in registers (the key zero and step
folded into the query once per block), never into a full-precision copy. Context lengths above
the table's width are clamped to it, a length <= 0 gives 0, and table entries past
ceil(len / block_size) are never read. Unlike the GPU kernels these check every block id they read
(and each staging slot) against the cache, raising ValueError.

The C++ is built once per machine (build.py); each vectorized routine exists for AVX-512, AVX2 and
plain C++, the best the CPU supports chosen at run time (`isa` forces a lower one, for tests).
Where the extension cannot be built, `available()` is False and the functions raise RuntimeError.
Tests and the benchmark against the engine's PyTorch decode: tests/kernels/test_cpu_paged_attention.py
(`bench()` drives the engine's caches, which kernels/ may not import).
"""

from __future__ import annotations

import enum
import math
from functools import cache
from pathlib import Path

import torch

from .build import ISAS, Extension, isa_cap

HEAD_DIMS = (64, 128)  # compiled head sizes
MAX_QUERY_ROWS = 16  # query rows per request of a multi-query decode (kMaxQueries in the C++)
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INDICES = (torch.int32, torch.int64)
_SOURCES = (
    Path(__file__).with_name("paged_attention.cpp"),
    Path(__file__).with_name("prefill_attention.cpp"),
)


class Isa(enum.IntEnum):
    """The vector paths of the extension, lowest first."""

    SCALAR = 1
    AVX2 = 2
    AVX512 = 3


_EXT = Extension("paged_attention", *_SOURCES)


def available() -> bool:
    """Whether the compiled kernels load here (the first call builds them)."""
    return _EXT.available()


_module = _EXT.module


@cache
def supported_isas() -> tuple[Isa, ...]:
    """Every path this CPU runs, lowest first (the last is the default)."""
    return tuple(Isa(level) for level in range(1, int(_module().best_isa()) + 1))


# -- input checks -------------------------------------------------------------------------------


def _tensor(name: str, t: object, dims: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in dtypes]}")
    return t


def _rows(name: str, t: object, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    """A tensor of exactly `shape` whose last dimension is contiguous (the kernel reads rows)."""
    x = _tensor(name, t, len(shape), dtypes)
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {shape}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dimension")


def _check_query(q: object, kv_heads: int, head_dim: int, *, rows: bool = False) -> int:
    """q [b, H, d] (or, where `rows`, [b, n, H, d] with 1 <= n <= MAX_QUERY_ROWS) against the
    cache's KV heads and head dim; returns b."""
    dims = q.dim() if rows and isinstance(q, torch.Tensor) and q.dim() == 4 else 3
    shape = _tensor("q", q, dims, FLOATS).shape
    if dims == 4 and not 1 <= shape[1] <= MAX_QUERY_ROWS:
        raise ValueError(f"q holds {shape[1]} query rows per request; 1 to {MAX_QUERY_ROWS} are taken")
    b, heads, d = shape[0], shape[-2], shape[-1]
    if d != head_dim:
        raise ValueError(f"head dims differ: q has {d}, the cache {head_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported (only {HEAD_DIMS})")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    return int(b)


def _check_tables(b: int, block_tables: object, context_lens: object) -> None:
    tables = _tensor("block_tables", block_tables, 2, INDICES)
    if tables.shape[0] != b:
        raise ValueError(f"block_tables {tuple(tables.shape)} must be [b={b}, max_blocks]")
    if tuple(_tensor("context_lens", context_lens, 1, INDICES).shape) != (b,):
        raise ValueError(f"context_lens must be [b={b}]")


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite Python number, got {scale!r}")
    return float(scale)


def _check_cache(k_cache: object, v_cache: object) -> tuple[int, int, int, int]:
    """k, v [kv_heads, num_blocks, block_size, d] alike in shape; returns that shape."""
    k = _tensor("k_cache", k_cache, 4, FLOATS)
    shape = (int(k.shape[0]), int(k.shape[1]), int(k.shape[2]), int(k.shape[3]))
    if shape[3] > 1 and k.stride(3) != 1:
        raise ValueError("k_cache needs a contiguous last dimension")
    _rows("v_cache", v_cache, shape, FLOATS)
    if shape[2] < 1:
        raise ValueError("block_size must be at least 1")
    return shape


def _isa_level(isa: Isa | None) -> int:
    if isa is None:
        return _default_level()
    if not isinstance(isa, Isa) or isa not in supported_isas():
        raise ValueError(f"isa {isa!r} is not one this CPU runs: {supported_isas()}")
    return int(isa)


@cache
def _default_level() -> int:
    cap = isa_cap()  # CTXFUSE_CPU_ISA, else the widest path (0)
    return 0 if cap is None else min(ISAS.index(cap) + 1, int(supported_isas()[-1]))


def _query32(q: torch.Tensor) -> torch.Tensor:
    return q if q.dtype == torch.float32 and q.is_contiguous() else q.to(torch.float32).contiguous()


def _as(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out if dtype == torch.float32 else out.to(dtype)


# -- the kernels --------------------------------------------------------------------------------


def paged_decode_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    isa: Isa | None = None,
    check: bool = True,
) -> torch.Tensor:
    """softmax(scale * q . K^T) V per request over its paged context. q: [b, H, d] fp32 / bf16 /
    fp16; k_cache, v_cache: [kv_heads, num_blocks, block_size, d] fp32 / bf16 / fp16 (any strides,
    last dim contiguous; d 64 or 128); block_tables [b, max_blocks], context_lens [b] int32 / int64.
    Query head h reads KV head h // (H / kv_heads). Returns [b, H, d] in q's dtype.
    Multi-query (a verify step's drafts, a short chunk after a long context): q [b, n, H, d] holds
    the queries of each request's last n positions, len - n .. len - 1, whose keys are in the cache;
    row i attends causally to keys 0 .. len - n + i, as `prefill_attention_cpu` would with start =
    len - n, but split over the context as decode is (one pass over the keys for all n rows).
    Returns [b, n, H, d].
    `check=False` skips the checks that name a bad argument (the C++ still refuses what would read
    out of bounds): for a caller that checked the same tables and shapes once already this step."""
    if check:
        kv_heads, _, _, d = _check_cache(k_cache, v_cache)
        b = _check_query(q, kv_heads, d, rows=True)
        _check_tables(b, block_tables, context_lens)
        scale = _check_scale(scale)
    out = _module().paged_decode(
        _query32(q), k_cache, v_cache, block_tables, context_lens, scale, _isa_level(isa)
    )
    return _as(out, q.dtype)


def sparse_paged_decode_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    selected: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    isa: Isa | None = None,
) -> torch.Tensor:
    """Attention of each query over its KV head's selected blocks only. As `paged_decode_cpu`, plus
    selected: [b, kv_heads, n] int32 / int64 block POSITIONS in the request's table (-1 or past the
    table: none; a position listed twice counts twice, as in the reference). Tokens at or past the
    context length are masked; a head with nothing live selected gets 0."""
    kv_heads, _, _, d = _check_cache(k_cache, v_cache)
    b = _check_query(q, kv_heads, d)
    _check_tables(b, block_tables, context_lens)
    _selected(selected, b, kv_heads)
    s = _check_scale(scale)
    level = _isa_level(isa)
    out = _module().sparse_paged_decode(
        _query32(q), k_cache, v_cache, block_tables, selected, context_lens, s, level
    )
    return _as(out, q.dtype)


def _selected(selected: torch.Tensor, b: int, kv_heads: int) -> torch.Tensor:
    sel = _tensor("selected", selected, 3, INDICES)
    if tuple(sel.shape[:2]) != (b, kv_heads):
        raise ValueError(f"selected {tuple(sel.shape)} must be [b={b}, kv_heads={kv_heads}, n]")
    return sel


def _check_quant(
    kq: torch.Tensor,
    vq: torch.Tensor,
    params: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    stage_of: torch.Tensor,
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    bits: int,
) -> tuple[int, int]:
    """The quantized layout (module docstring of kernels/triton/paged_decode_quant.py); returns
    (kv_heads, head_dim)."""
    if isinstance(bits, bool) or bits not in (4, 8):
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    codes = _tensor("kq", kq, 4, (torch.uint8,))
    h, nb, bs, w = (int(x) for x in codes.shape)
    d = int(_tensor("kmin", params[0], 3, (torch.float16,)).shape[2])
    if w != (d if bits == 8 else d // 2) or (bits == 4 and d % 2):
        raise ValueError(f"codes {w} bytes wide do not hold int{bits} vectors of {d} channels")
    if bs < 1:
        raise ValueError("block_size must be at least 1")
    _rows("kq", kq, (h, nb, bs, w), (torch.uint8,))
    _rows("vq", vq, (h, nb, bs, w), (torch.uint8,))
    for name, t in zip(("kmin", "kmax"), params[:2], strict=True):
        _rows(name, t, (h, nb, d), (torch.float16,))
    for name, t in zip(("vscale", "vzero"), params[2:], strict=True):
        _rows(name, t, (h, nb, bs), (torch.float16,))
    if tuple(_tensor("stage_of", stage_of, 1, INDICES).shape) != (nb,):
        raise ValueError(f"stage_of must be [num_blocks={nb}]")
    slots = int(_tensor("stage_k", stage_k, 4, FLOATS).shape[1])
    _rows("stage_k", stage_k, (h, slots, bs, d), FLOATS)
    _rows("stage_v", stage_v, (h, slots, bs, d), FLOATS)
    return h, d


def paged_decode_quant_cpu(
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
    selected: torch.Tensor | None = None,
    isa: Isa | None = None,
) -> torch.Tensor:
    """Decode attention over the engine's int8 / int4 cache (cloud/engine/kv/quantized_cache.py):
    kq, vq [kv_heads, num_blocks, bs, w] uint8 (int4: even channel in the low nibble); kmin, kmax
    [kv_heads, num_blocks, d] fp16 (key = kmin + code * key_scale(kmin, kmax)); vscale, vzero
    [kv_heads, num_blocks, bs] fp16 (value = vzero + code * vscale); stage_of [num_blocks] (-1 or
    the slot of a staged block, read in full precision from stage_k / stage_v [kv_heads, slots, bs,
    d]); the rest as `paged_decode_cpu` (q [b, n, H, d] too). Returns q's shape in q's dtype.
    `selected`: block-sparse, as `sparse_paged_decode_cpu` (q [b, H, d], [b, kv_heads, n] positions)."""
    kv_heads, d = _check_quant(kq, vq, (kmin, kmax, vscale, vzero), stage_of, stage_k, stage_v, bits)
    b = _check_query(q, kv_heads, d, rows=selected is None)
    _check_tables(b, block_tables, context_lens)
    if selected is not None:
        selected = _selected(selected, b, kv_heads)
    s = _check_scale(scale)
    level = _isa_level(isa)
    out = _module().paged_decode_quant(
        _query32(q),
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
        s,
        bits,
        level,
        selected,
    )
    return _as(out, q.dtype)


def prefill_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    isa: Isa | None = None,
) -> torch.Tensor:
    """Causal attention of a prefill chunk: q [n, H, d] fp32 holds positions start .. start + n - 1,
    whose keys and values (and all earlier ones) are already in the fp32 cache k_cache, v_cache
    [kv_heads, num_blocks, block_size, d] at the blocks block_table [>= ceil((start + n) /
    block_size)] (int32 / int64) lists. Row t attends keys 0 .. start + t. d: a multiple of 8 up to
    256. Writes into `out` ([n, H, d] fp32, last dim contiguous) when given; returns [n, H, d] fp32."""
    x = _tensor("q", q, 3, (torch.float32,))
    kv_heads, _, _, d = _check_cache(k_cache, v_cache)
    if k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
        raise ValueError(f"the prefill kernel reads an fp32 cache, got {k_cache.dtype} / {v_cache.dtype}")
    if x.shape[2] != d:
        raise ValueError(f"head dims differ: q has {x.shape[2]}, the cache {d}")
    if kv_heads < 1 or x.shape[1] % kv_heads:
        raise ValueError(f"{x.shape[1]} query heads are not a multiple of {kv_heads} KV heads")
    _tensor("block_table", block_table, 1, INDICES)
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    if out is not None:
        _rows("out", out, tuple(int(s) for s in x.shape), (torch.float32,))
    result: torch.Tensor = _module().prefill_attention(
        x, k_cache, v_cache, block_table, start, _check_scale(scale), out, _isa_level(isa)
    )
    return result
