"""Quest block selection and sparse paged decode against their PyTorch references, dense attention, and
the engine's own block-sparse decode (under TRITON_INTERPRET=1 on the CPU: tiny grids)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.triton.quest_select import quest_select, quest_select_bytes, quest_select_reference
from kernels.triton.sparse_decode import (
    sparse_decode_bytes,
    sparse_paged_decode,
    sparse_paged_decode_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS = 16  # tokens per block
# fp32 dots run as tf32 on a GPU
ATOL = 2e-3 if DEVICE == "cuda" else 1e-4


def _layout(lens: list[int], num_blocks: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables of shuffled, non-consecutive block ids (one spare column padded with 0)."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-n // BS) for n in lens]
    ids = torch.randperm(num_blocks, generator=g)
    assert sum(nblk) <= num_blocks
    tables = torch.zeros(len(lens), max(nblk) + 1, dtype=torch.int64)
    at = 0
    for r, n in enumerate(nblk):
        tables[r, :n] = ids[at : at + n]
        at += n
    return tables.to(DEVICE), torch.tensor(lens, device=DEVICE)


def _summaries(kv_heads: int, num_blocks: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kmin = torch.randn(kv_heads, num_blocks, d, generator=g)
    kmax = kmin + torch.rand(kv_heads, num_blocks, d, generator=g) * 2
    return kmin.half().to(DEVICE), kmax.half().to(DEVICE)


def _cache(kv_heads: int, num_blocks: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """K and V caches [kv_heads, num_blocks, BS, d]; V a strided view (padded last-but-one dims)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kv_heads, num_blocks, BS, d, generator=g).to(dtype)
    v = torch.randn(kv_heads, num_blocks + 2, BS, d + 8, generator=g).to(dtype)[:, 1:-1, :, :d]
    return k.to(DEVICE), v.to(DEVICE)


def _query(batch: int, heads: int, d: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(batch, heads, d, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def _dense_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention over each row's whole context [0, len)."""
    b, heads, d = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    out = torch.zeros(b, heads, d, device=q.device)
    for r in range(b):
        n = int(lens[r])
        ids = tables[r, : -(-n // BS)]
        for h in range(kv_heads):
            k = k_cache[h, ids].float().reshape(-1, d)[:n]
            v = v_cache[h, ids].float().reshape(-1, d)[:n]
            qg = q[r, h * group : (h + 1) * group].float()
            out[r, h * group : (h + 1) * group] = torch.softmax(qg @ k.T * scale, -1) @ v
    return out


# -- quest_select -------------------------------------------------------------------------------

# rows: a long one, a short one with an empty middle (nblk < sinks + window), a middling one
LENS = [17 * BS - 5, 2 * BS + 3, 9 * BS]


@pytest.mark.parametrize(
    ("group", "d", "sinks", "window", "top_k", "block_n"),
    [
        (1, 64, 1, 2, 3, None),
        (3, 128, 2, 1, 4, 16),  # a 14-block middle in one 16-block tile
        (8, 64, 0, 0, 5, 16),  # no sinks, no window: a 17-block middle in two tiles
        (3, 64, 1, 2, 0, None),  # top_k = 0: sinks and window only
        (1, 128, 1, 1, 20, None),  # top_k >= every middle: all blocks
    ],
)
def test_quest_select_equals_reference(
    group: int, d: int, sinks: int, window: int, top_k: int, block_n: int | None
) -> None:
    kv_heads, num_blocks = 2, 40
    tables, lens = _layout(LENS, num_blocks, seed=d + group)
    kmin, kmax = _summaries(kv_heads, num_blocks, d, seed=group)
    q = _query(len(LENS), kv_heads * group, d, seed=top_k)
    args = (q, kmin, kmax, tables.int(), lens, sinks, window, top_k)
    got = quest_select(*args, block_size=BS, block_n=block_n)
    want = quest_select_reference(*args, block_size=BS)
    assert got.dtype == torch.int32 and got.shape == (3, kv_heads, sinks + top_k + window)
    assert torch.equal(got, want)
    # the short row keeps its 3 blocks once each
    assert got[1, 0, :3].tolist() == [0, 1, 2] and bool((got[1, :, 3:] == -1).all())
    if top_k >= 17:
        assert got[0, 0, :17].tolist() == list(range(17))


def test_quest_select_merges_tiles_of_a_long_middle() -> None:
    """A 31-block middle in two 16-block tiles after two sinks; fp16 queries, int64 tables, a strided
    kmax."""
    kv_heads, group, d, num_blocks = 2, 3, 64, 60
    tables, lens = _layout([36 * BS - 1, 20 * BS + 2], num_blocks, seed=4)
    kmin, kmax = _summaries(kv_heads, num_blocks, d, seed=4)
    kmax = torch.cat([kmax, kmax], -1)[..., :d]  # strides of its own
    q = _query(2, kv_heads * group, d, seed=4, dtype=torch.float16)
    for top_k in (7, 16):
        args = (q, kmin, kmax, tables, lens, 2, 3, top_k)
        got = quest_select(*args, block_size=BS, block_n=16)
        assert torch.equal(got, quest_select_reference(*args, block_size=BS))


def test_quest_select_breaks_ties_toward_lower_positions() -> None:
    kv_heads, d, num_blocks = 1, 64, 40
    tables, lens = _layout([36 * BS], num_blocks, seed=1)
    kmin = torch.zeros(kv_heads, num_blocks, d, dtype=torch.float16, device=DEVICE)
    kmax = torch.ones_like(kmin)
    q = torch.ones(1, 2, d, device=DEVICE)  # every middle block bounds at d: all tie
    args = (q, kmin, kmax, tables, lens, 1, 1, 5)
    got = quest_select(*args, block_size=BS, block_n=16)  # the middle spans three tiles
    assert torch.equal(got, quest_select_reference(*args, block_size=BS))
    assert got[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 35]


# -- sparse_paged_decode ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("group", "d", "dtype", "num_splits"),
    [
        (1, 64, torch.float32, None),
        (3, 128, torch.float16, 3),
        (8, 64, torch.bfloat16, 1),
        (3, 64, torch.float32, 7),  # more splits than some rows' lists: empty splits
    ],
)
def test_sparse_decode_equals_reference(
    group: int, d: int, dtype: torch.dtype, num_splits: int | None
) -> None:
    kv_heads, num_blocks = 2, 40
    tables, lens = _layout(LENS, num_blocks, seed=group)
    kmin, kmax = _summaries(kv_heads, num_blocks, d, seed=d)
    k_cache, v_cache = _cache(kv_heads, num_blocks, d, dtype, seed=group)
    q = _query(len(LENS), kv_heads * group, d, seed=7, dtype=dtype)
    sel = quest_select_reference(q, kmin, kmax, tables, lens, 1, 2, 3, block_size=BS)
    sel[2, 1] = -1  # a head with nothing to attend to: 0, no NaN
    scale = d**-0.5
    out = sparse_paged_decode(q, k_cache, v_cache, tables, sel, lens, scale, num_splits=num_splits)
    want = sparse_paged_decode_reference(q, k_cache, v_cache, tables, sel, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = ATOL if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    assert torch.count_nonzero(out[2, group:]) == 0


def test_sparse_decode_of_empty_lists_is_zero() -> None:
    kv_heads, group, d, num_blocks = 2, 3, 64, 40
    tables, lens = _layout(LENS, num_blocks, seed=3)
    k_cache, v_cache = _cache(kv_heads, num_blocks, d, torch.float32, seed=3)
    q = _query(len(LENS), kv_heads * group, d, seed=3)
    none = torch.full((3, kv_heads, 4), -1, dtype=torch.int32, device=DEVICE)
    out = sparse_paged_decode(q, k_cache, v_cache, tables, none, lens, 0.125, out=torch.full_like(q, 5.0))
    assert torch.count_nonzero(out) == 0
    width0 = none[:, :, :0]  # sinks = window = top_k = 0
    out = sparse_paged_decode(q, k_cache, v_cache, tables, width0, lens, 0.125, out=torch.full_like(q, 5.0))
    assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize(("group", "d"), [(1, 128), (8, 64)])
def test_full_selection_equals_dense_attention(group: int, d: int) -> None:
    """With top_k covering every middle block, sparse attention is dense attention."""
    kv_heads, num_blocks = 2, 40
    tables, lens = _layout(LENS, num_blocks, seed=11)
    kmin, kmax = _summaries(kv_heads, num_blocks, d, seed=11)
    k_cache, v_cache = _cache(kv_heads, num_blocks, d, torch.float32, seed=11)
    q = _query(len(LENS), kv_heads * group, d, seed=11)
    sel = quest_select(q, kmin, kmax, tables, lens, 1, 2, 16, block_size=BS)
    out = sparse_paged_decode(q, k_cache, v_cache, tables, sel, lens, d**-0.5, num_splits=2)
    want = _dense_reference(q, k_cache, v_cache, tables, lens, d**-0.5)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=ATOL)


# -- against the engine -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_heads", "group", "d", "dtype"),
    [(2, 3, 64, torch.float32), (1, 8, 128, torch.float32), (2, 1, 64, torch.bfloat16)],
)
def test_matches_engine_sparse_decode(kv_heads: int, group: int, d: int, dtype: torch.dtype) -> None:
    from cloud.engine.attention.dense import DenseAttention
    from cloud.engine.attention.sparse import SparseAttention
    from cloud.engine.config import SparseConfig
    from cloud.engine.kv.cache import KVCache

    num_blocks, heads = 40, kv_heads * group
    lens = [19 * BS - 7, 8 * BS + 1, 7 * BS + 5]  # all above the budget (7 blocks)
    tables, lens_t = _layout(lens, num_blocks, seed=5)
    tables, lens_t = tables.cpu(), lens_t.cpu()
    cache = KVCache(1, num_blocks, BS, kv_heads, d, dtype, track_summaries=True)
    slots = torch.cat(
        [tables[r, torch.arange(n) // BS] * BS + torch.arange(n) % BS for r, n in enumerate(lens)]
    )
    g = torch.Generator().manual_seed(kv_heads * d)
    k, v = (torch.randn(len(slots), kv_heads, d, generator=g).to(dtype) for _ in range(2))
    cache.begin_step(slots)
    cache.write(0, k, v, slots)
    config = SparseConfig(sinks=BS + 1, window=2 * BS, budget=7 * BS, dense_layers=0)  # 2 + 2 + top 3
    sparse = SparseAttention(DenseAttention(heads, kv_heads, d), config, BS)
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    want = sparse._sparse_decode(0, q, cache, tables, lens_t)

    assert cache.summaries is not None
    kmin, kmax = cache.summaries.kmin[0].to(DEVICE), cache.summaries.kmax[0].to(DEVICE)
    k_cache = cache.k[0].view(kv_heads, num_blocks, BS, d).to(DEVICE)
    v_cache = cache.v[0].view(kv_heads, num_blocks, BS, d).to(DEVICE)
    qd, tables_d, lens_d = q.to(DEVICE), tables.int().to(DEVICE), lens_t.to(DEVICE)
    blocks = (sparse.sink_blocks, sparse.window_blocks, sparse.top_blocks)
    assert blocks == (2, 2, 3)
    sel = quest_select(qd, kmin, kmax, tables_d, lens_d, 2, 2, 3, block_size=BS)
    assert torch.equal(sel, quest_select_reference(qd, kmin, kmax, tables_d, lens_d, 2, 2, 3, block_size=BS))
    out = sparse_paged_decode(qd, k_cache, v_cache, tables_d, sel, lens_d, sparse.dense.scale)
    tol = ATOL if dtype == torch.float32 else 2e-2  # the engine attends in bf16
    torch.testing.assert_close(out.cpu().float(), want.float(), atol=tol, rtol=tol)


# -- wrappers -----------------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE != "cuda", reason="host syncs only show on a GPU")
def test_wrappers_never_sync_with_the_device() -> None:
    kv_heads, group, d, num_blocks = 2, 3, 64, 40
    tables, lens = _layout(LENS, num_blocks, seed=2)
    kmin, kmax = _summaries(kv_heads, num_blocks, d, seed=2)
    k_cache, v_cache = _cache(kv_heads, num_blocks, d, torch.float16, seed=2)
    q = _query(len(LENS), kv_heads * group, d, seed=2, dtype=torch.float16)
    sel = quest_select(q, kmin, kmax, tables, lens, 1, 2, 3, block_size=BS)  # compiles: may sync
    sparse_paged_decode(q, k_cache, v_cache, tables, sel, lens, 0.1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sel = quest_select(q, kmin, kmax, tables, lens, 1, 2, 3, block_size=BS)
        sparse_paged_decode(q, k_cache, v_cache, tables, sel, lens, 0.1)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _on_device(change: dict[str, Any]) -> dict[str, Any]:
    """Bad inputs move to DEVICE (those on the meta device stay there: a device mismatch)."""
    return {
        k: v.to(DEVICE) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
        for k, v in change.items()
    }


def _select_args() -> dict[str, Any]:
    kmin, kmax = _summaries(2, 8, 64, seed=0)
    tables, lens = _layout([40, 20], 8, seed=0)
    return {
        "q": _query(2, 6, 64, seed=0),
        "kmin": kmin,
        "kmax": kmax,
        "block_tables": tables,
        "context_lens": lens,
        "sink_blocks": 1,
        "window_blocks": 1,
        "top_k": 2,
    }


def _decode_args() -> dict[str, Any]:
    k_cache, v_cache = _cache(2, 8, 64, torch.float32, seed=0)
    tables, lens = _layout([40, 20], 8, seed=0)
    sel = torch.zeros(2, 2, 3, dtype=torch.int32, device=DEVICE)
    return {
        "q": _query(2, 6, 64, seed=0),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": tables,
        "selected": sel,
        "context_lens": lens,
        "scale": 0.125,
    }


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"q": torch.zeros(2, 6)}, "q must have 3 dimensions"),
        ({"q": torch.zeros(2, 6, 64, dtype=torch.int32)}, "float32, float16 or bfloat16"),
        ({"q": torch.zeros(2, 64, 6).transpose(1, 2)}, "contiguous last dimension"),
        ({"q": torch.zeros(2, 5, 64)}, "whole number of groups"),
        ({"q": torch.zeros(2, 6, 32)}, "head dim mismatch"),
        ({"kmax": torch.zeros(2, 9, 64)}, "differ in shape"),
        ({"block_tables": torch.zeros(3, 4, dtype=torch.int32)}, r"block_tables must have shape \[2, \*\]"),
        ({"block_tables": torch.zeros(2, 4)}, "int32 or int64"),
        ({"context_lens": torch.zeros(2, 1, dtype=torch.int32)}, r"context_lens must have shape \[2\]"),
        ({"top_k": -1}, "top_k must be a non-negative int"),
        ({"sink_blocks": 1.0}, "sink_blocks must be a non-negative int"),
        ({"top_k": 5000}, "above 1024"),
        ({"block_size": 0}, "block_size must be a positive int"),
        ({"block_n": 8}, "block_n must be a power of two"),
        ({"block_n": 48}, "block_n must be a power of two"),
        ({"context_lens": torch.zeros(2, dtype=torch.int32, device="meta")}, "one device"),
    ],
)
def test_quest_select_refuses_bad_input(change: dict[str, Any], match: str) -> None:
    args = _select_args() | {"block_size": BS} | _on_device(change)
    with pytest.raises(ValueError, match=match):
        quest_select(**args)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"k_cache": torch.zeros(2, 8, 16, 32)}, "differ in shape"),
        ({"v_cache": torch.zeros(2, 8, 16, 64, dtype=torch.float64)}, "float32, float16 or bfloat16"),
        ({"k_cache": torch.zeros(2, 8, 12, 64), "v_cache": torch.zeros(2, 8, 12, 64)}, "power of two"),
        ({"k_cache": torch.zeros(2, 8, 64, 16).transpose(2, 3)}, "k_cache needs a contiguous last dimension"),
        ({"selected": torch.zeros(2, 3, 4, dtype=torch.int32)}, r"selected must have shape \[2, 2, \*\]"),
        ({"selected": torch.zeros(2, 2, 4)}, "selected must be int32 or int64"),
        ({"scale": torch.tensor(0.1)}, "scale must be a Python number"),
        ({"num_splits": 0}, "num_splits must be a positive int"),
        ({"out": torch.zeros(2, 6, 32)}, "out must have q's shape"),
        ({"out": torch.zeros(2, 6, 64, device="meta")}, "one device"),
    ],
)
def test_sparse_decode_refuses_bad_input(change: dict[str, Any], match: str) -> None:
    args = _decode_args() | _on_device(change)
    with pytest.raises(ValueError, match=match):
        sparse_paged_decode(**args)


def test_bytes_helpers() -> None:
    # 4 rows of 1000 tokens: 63 blocks, 60 in the middle; per block 2 * 128 * 2 + 4 bytes
    assert quest_select_bytes(4, 32, 8, 128, 1000, 16, 1, 2) == 4 * 32 * 128 * 2 + 4 * 8 * 60 * 516 + 16
    # per selected block: K and V (2 * 16 * 128 * 2) + position and table entry (8)
    got = sparse_decode_bytes(4, 32, 8, 128, 10, 16, num_splits=2)
    assert got == 2 * 4 * 32 * 128 * 2 + 4 * 8 * 10 * (8192 + 8) + 4 * 32 * 2 * 129 * 4
