"""Block-sparse attention against the dense reference: equal when the budget covers the context,
and when it does not, it finds the blocks that matter (per KV head) by their key bounds."""

from __future__ import annotations

import pytest
import torch

from cloud.engine.attention.dense import AttentionMetadata, DenseAttention, PrefillSeq
from cloud.engine.attention.retrieval_heads import HeadCalibration
from cloud.engine.attention.sparse import SparseAttention
from cloud.engine.config import SparseConfig
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.quantized_cache import QuantizedKVCache
from shared.errors import InvalidRequestError

BS, HEADS, KV_HEADS, DIM, BLOCKS = 4, 4, 2, 16, 24
SMALL = SparseConfig(sinks=4, window=8, budget=24, dense_layers=0)  # 1 sink, 2 window, 3 top blocks


def _setup(n: int, seed: int = 0) -> tuple[KVCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(1, BLOCKS, BS, KV_HEADS, DIM, torch.float32, track_summaries=True)
    k = torch.randn(n, KV_HEADS, DIM, generator=g)
    v = torch.randn(n, KV_HEADS, DIM, generator=g)
    q = torch.randn(1, HEADS, DIM, generator=g)
    return cache, k, v, q


def _fill(cache: KVCache, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    slots = torch.arange(k.shape[0])
    cache.begin_step(slots)
    cache.write(0, k, v, slots)
    return torch.arange(-(-k.shape[0] // BS))  # the block table


def _decode_meta(table: torch.Tensor, n: int) -> AttentionMetadata:
    width = table.numel() * BS
    mask = (torch.arange(width) < n).view(1, 1, 1, -1) if n < width else None
    return AttentionMetadata(torch.tensor([n - 1]), 1, table[None], mask, [], torch.tensor([n]))


def _attn(config: SparseConfig = SMALL) -> tuple[DenseAttention, SparseAttention]:
    dense = DenseAttention(HEADS, KV_HEADS, DIM)
    return dense, SparseAttention(dense, config, BS)


def _plant(k: torch.Tensor, q: torch.Tensor, block: int, kv_head: int) -> None:
    """Make one middle block hold keys that the kv head's queries attend to almost alone."""
    g = HEADS // KV_HEADS
    direction = q[0, kv_head * g : (kv_head + 1) * g].sum(0)
    k[block * BS : (block + 1) * BS, kv_head] = 40 * direction / direction.norm()


def test_budget_covering_the_context_equals_dense_bit_for_bit() -> None:
    dense, sparse = _attn()
    cache, k, v, q = _setup(22)  # 22 tokens <= budget 24; the last block is partly filled
    meta = _decode_meta(_fill(cache, k, v), 22)
    assert torch.equal(sparse(0, q, k[:1], v[:1], cache, meta), dense(0, q, k[:1], v[:1], cache, meta))


def test_quest_bound_is_an_upper_bound_on_every_key_of_the_block() -> None:
    _, sparse = _attn()
    cache, k, v, q = _setup(64, seed=1)
    table = _fill(cache, k, v)
    qg = q.view(1, KV_HEADS, HEADS // KV_HEADS, DIM)
    bound = sparse._bounds(0, cache, qg, table[None])[0]  # [kv_heads, blocks]
    kb = k.view(-1, BS, KV_HEADS, DIM).permute(2, 0, 1, 3)  # [kv_heads, blocks, bs, d]
    exact = torch.einsum("hgd,hbtd->hgbt", qg[0], kb).amax(-1).amax(1)  # best query of the group
    assert bool((bound >= exact - 1e-2).all())


def test_sparse_decode_finds_each_kv_heads_needle_block() -> None:
    dense, sparse = _attn()
    cache, k, v, q = _setup(64, seed=2)  # 16 blocks, budget 6 blocks
    _plant(k, q, block=6, kv_head=0)
    _plant(k, q, block=9, kv_head=1)
    meta = _decode_meta(_fill(cache, k, v), 64)
    want = dense(0, q, k[:1], v[:1], cache, meta)
    got = sparse(0, q, k[:1], v[:1], cache, meta)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    # a budget too small to hold the needle block misses it: the test can tell the two apart
    _, blind = _attn(SparseConfig(sinks=4, window=8, budget=12, dense_layers=0))
    assert not torch.allclose(blind(0, q, k[:1], v[:1], cache, meta), want, atol=1e-2)


def test_top_p_keeps_only_the_dominant_block() -> None:
    dense, sparse = _attn(SparseConfig(sinks=4, window=8, budget=24, dense_layers=0, top_p=0.5))
    cache, k, v, q = _setup(64, seed=3)
    _plant(k, q, block=7, kv_head=0)
    _plant(k, q, block=7, kv_head=1)
    meta = _decode_meta(_fill(cache, k, v), 64)
    torch.testing.assert_close(
        sparse(0, q, k[:1], v[:1], cache, meta), dense(0, q, k[:1], v[:1], cache, meta), atol=1e-3, rtol=0
    )
    kept = sparse._within_top_p(torch.tensor([[10.0, 1.0, 0.5]]))
    assert kept.tolist() == [[True, False, False]]


def test_mixed_decode_batch_routes_short_rows_to_dense() -> None:
    dense, sparse = _attn()
    cache, k, v, _ = _setup(96, seed=4)
    table = _fill(cache, k, v)  # 24 blocks: row 0 reads the first 5 (20 tokens), row 1 all 96 tokens
    q = torch.randn(2, HEADS, DIM, generator=torch.Generator().manual_seed(5))
    blocks = torch.stack([torch.cat([table[:5], torch.zeros(19, dtype=torch.long)]), table])
    mask = (torch.arange(96)[None, :] < torch.tensor([[20], [96]])).view(2, 1, 1, 96)
    meta = AttentionMetadata(torch.tensor([19, 95]), 2, blocks, mask, [], torch.tensor([20, 96]))
    out = sparse(0, q, k[:2], v[:2], cache, meta)
    assert torch.equal(out[0], dense(0, q, k[:2], v[:2], cache, meta)[0])
    alone = AttentionMetadata(torch.tensor([95]), 1, table[None], None, [], torch.tensor([96]))
    torch.testing.assert_close(out[1:], sparse(0, q[1:], k[:1], v[:1], cache, alone))


def test_sparse_prefill_after_a_long_prefix_finds_the_needle() -> None:
    dense, sparse = _attn()
    g = torch.Generator().manual_seed(6)
    n_prefix, n_chunk = 64, 8
    cache, k, v, _ = _setup(n_prefix + n_chunk, seed=6)
    q = torch.randn(n_chunk, HEADS, DIM, generator=g) * 0.1
    q[:] += torch.randn(1, HEADS, DIM, generator=g)  # the chunk's queries share one interest
    _plant(k, q[-1:], block=5, kv_head=0)
    _plant(k, q[-1:], block=8, kv_head=1)
    table = _fill(cache, k, v)
    seq = PrefillSeq(0, n_chunk, n_prefix, table)
    meta = AttentionMetadata(torch.arange(n_prefix, n_prefix + n_chunk), 0, None, None, [seq])
    kc, vc = k[n_prefix:], v[n_prefix:]
    torch.testing.assert_close(
        sparse(0, q, kc, vc, cache, meta), dense(0, q, kc, vc, cache, meta), atol=2e-3, rtol=0
    )


def test_sparse_reads_a_quantized_cache_like_a_full_precision_one() -> None:
    dense, sparse = _attn()
    _, k, v, q = _setup(64, seed=7)
    _plant(k, q, block=6, kv_head=0)
    _plant(k, q, block=10, kv_head=1)
    quant = QuantizedKVCache(1, BLOCKS, BS, KV_HEADS, DIM, torch.float32, 8, lambda b: False)
    meta = _decode_meta(_fill(quant, k, v), 64)  # type: ignore[arg-type]
    torch.testing.assert_close(
        sparse(0, q, k[:1], v[:1], quant, meta), dense(0, q, k[:1], v[:1], quant, meta), atol=5e-3, rtol=0
    )


def test_selection_by_head_keeps_a_quiet_heads_block_that_the_groups_bound_outvotes() -> None:
    """Head 0 of KV head 0 looks for one block, with small logits; head 1 of the group has large bounds
    everywhere else. By the group's best bound head 0's block ranks last; by each head's own order it
    ranks first for head 0, so it is picked."""
    cache, k, v, q = _setup(64, seed=3)  # 16 blocks: 1 sink, 2 window, 13 middle; 3 picked
    q[0, 1] *= 50  # head 1: every bound loud
    quiet = q[0, 0] / q[0, 0].norm()
    k[6 * BS : 7 * BS, 0] = 10 * quiet  # head 0's block: the best for head 0, modest beside head 1
    table = _fill(cache, k, v)
    lens = torch.tensor([64])
    picked = {}
    for mode in ("group", "head"):
        _, sparse = _attn(SparseConfig(sinks=4, window=8, budget=24, dense_layers=0, select=mode))
        sel, keep = sparse.select(0, q, cache, table[None], lens)
        picked[mode] = set(sel[0, 0][keep[0, 0]].tolist())
    assert 6 in picked["head"] and 6 not in picked["group"]
    assert len(picked["head"]) == len(picked["group"]) == 6  # the same budget: 1 sink, 3 picked, 2 window


def test_retrieval_heads_attend_densely_and_the_others_as_before() -> None:
    """KV head 0 marked a retrieval head: its query heads get dense attention's output (every block);
    KV head 1's keep the plain sparse output. (The compiled kernel's path: test_retrieval_heads.py.)"""
    dense, sparse = _attn()
    mixed = SparseAttention(dense, SMALL, BS, dense_heads=torch.tensor([[True, False]]))
    cache, k, v, q = _setup(64, seed=8)
    meta = _decode_meta(_fill(cache, k, v), 64)
    args = (0, q, k[:1], v[:1], cache, meta)
    want_dense, want_sparse, got = dense(*args), sparse(*args), mixed(*args)
    g = HEADS // KV_HEADS
    torch.testing.assert_close(got[:, :g], want_dense[:, :g], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[:, g:], want_sparse[:, g:], atol=1e-6, rtol=0)  # masked padding: same sum
    assert not torch.allclose(want_sparse[:, :g], want_dense[:, :g], atol=1e-3)  # the budget matters here
    # a layer with a retrieval head prefills densely
    seq = PrefillSeq(0, 8, 56, _fill(cache, k, v))
    pre = AttentionMetadata(torch.arange(56, 64), 0, None, None, [seq])
    qp = torch.randn(8, HEADS, DIM, generator=torch.Generator().manual_seed(9))
    assert torch.equal(mixed(0, qp, k[56:], v[56:], cache, pre), dense(0, qp, k[56:], v[56:], cache, pre))


def test_a_head_calibration_of_another_shape_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cal = HeadCalibration(
        model="m", num_layers=2, num_heads=4, num_kv_heads=2, cases=1, queries=3, mass=[[0.0] * 4] * 2
    )
    cal.save(tmp_path / "heads.json")
    loaded = HeadCalibration.load(tmp_path / "heads.json", 2, 4, 2)
    assert loaded.dense_kv_heads(0.1).tolist() == [[False, False], [False, False]]
    with pytest.raises(InvalidRequestError, match="calibrated for 2 layers x 4 heads"):
        HeadCalibration.load(tmp_path / "heads.json", 30, 9, 3)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(InvalidRequestError, match="not a head calibration"):
        HeadCalibration.load(tmp_path / "bad.json", 2, 4, 2)
    marked = HeadCalibration(
        model="m",
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        cases=1,
        queries=3,
        mass=[[0.0, 0.3, 0.05, 0.09]],
    )
    assert marked.dense_kv_heads(0.1).tolist() == [[True, False]]
