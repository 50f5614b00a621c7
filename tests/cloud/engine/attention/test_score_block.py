"""Scoring blocks by their parts (`--sparse-score-block`, SparseConfig.score_block): a KV block keeps
a key summary per run of score_block tokens, sparse selection bounds each block by its best part,
and attention reads the same whole blocks. The bound stays an upper bound, is never looser than the
whole block's, and can rank a needle block above one whose keys only look large spread together."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch

from cloud.engine.attention.dense import AttentionMetadata, DenseAttention
from cloud.engine.attention.sparse import SparseAttention
from cloud.engine.config import EngineConfig, SparseConfig
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.memory import summary_parts
from ctxfuse.engine_cli import add_engine_options, engine_config
from kernels.cpu.paged_attention import available as cpu_kernels_available
from shared.engine_types import SamplingParams
from shared.errors import InvalidRequestError
from tests.cloud.engine.recording import recorded_sparse_core

BS, HEADS, KV_HEADS, DIM = 8, 4, 2, 16


def _cache(parts: int, blocks: int = 12, dim: int = DIM, kv_heads: int = KV_HEADS) -> KVCache:
    return KVCache(1, blocks, BS, kv_heads, dim, torch.float32, track_summaries=True, summary_parts=parts)


def _write(cache: KVCache, k: torch.Tensor, slots: torch.Tensor) -> None:
    cache.begin_step(slots)
    cache.write(0, k, torch.zeros_like(k), slots)


def test_each_part_summarizes_its_own_tokens_as_blocks_fill_and_are_reused() -> None:
    g = torch.Generator().manual_seed(0)
    cache = _cache(parts=4)  # 2 tokens per summary
    keys = torch.randn(40, KV_HEADS, DIM, generator=g)
    _write(cache, keys[:13], torch.arange(13))  # a prefill: blocks 0 and 1 (5 tokens)
    for s in range(13, 24):  # decode, a token a step, to the end of block 2
        _write(cache, keys[s : s + 1], torch.tensor([s]))
    reused = torch.randn(8, KV_HEADS, DIM, generator=g) * 5
    _write(cache, reused, torch.arange(8, 16))  # block 1 taken by another request, whole
    held = torch.cat([keys[:8], reused, keys[16:24]])  # what blocks 0-2 hold now
    kmin, kmax = cache.key_bounds(0)
    assert kmin.shape == (KV_HEADS, 12, 4, DIM)
    want = held.view(3, 4, 2, KV_HEADS, DIM).movedim(3, 0)  # [kvh, block, part, token, d]
    assert torch.equal(kmin[:, :3], want.amin(3).half())
    assert torch.equal(kmax[:, :3], want.amax(3).half())


def test_a_block_in_parts_is_bounded_by_its_best_part_and_never_looser() -> None:
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(96, KV_HEADS, DIM, generator=g)
    q = torch.randn(1, HEADS, DIM, generator=g)
    qg = q.view(1, KV_HEADS, HEADS // KV_HEADS, DIM)
    table = torch.arange(12)[None]
    dense = DenseAttention(HEADS, KV_HEADS, DIM)
    bounds = {}
    for parts in (1, 2, 4):
        cache = _cache(parts)
        _write(cache, keys, torch.arange(96))
        sparse = SparseAttention(dense, SparseConfig(score_block=BS // parts), BS)
        bounds[parts] = sparse._bounds(0, cache, qg, table)[0]  # [kv_heads, blocks]
    kb = keys.view(12, BS, KV_HEADS, DIM).permute(2, 0, 1, 3)  # [kv_heads, blocks, bs, d]
    exact = torch.einsum("hgd,hbtd->hgbt", qg[0], kb).amax(-1).amax(1)  # the group's best key
    tol = 1e-2  # fp16 summaries
    assert bool((bounds[4] >= exact - tol).all())
    assert bool((bounds[4] <= bounds[2] + tol).all()) and bool((bounds[2] <= bounds[1] + tol).all())
    assert bool((bounds[4] < bounds[1] - 0.5).any())  # tighter somewhere, by more than rounding


def _decoy_and_needle() -> tuple[KVCache, KVCache, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two channels, one KV head. Block 3's halves hold (6, -6) and (-6, 6): with q = (1, 1) its
    whole-block bound is 12 and its best key scores 0. Block 5 holds the needle, (5, 5): 10 both ways."""
    n = 10 * BS
    k = torch.zeros(n, 1, 2)
    k[3 * BS : 3 * BS + 4, 0] = torch.tensor([6.0, -6.0])
    k[3 * BS + 4 : 4 * BS, 0] = torch.tensor([-6.0, 6.0])
    k[5 * BS : 6 * BS, 0] = torch.tensor([5.0, 5.0])
    v = torch.zeros(n, 1, 2)
    v[5 * BS : 6 * BS, 0] = torch.tensor([1.0, -1.0])  # what the needle's block answers
    caches = []
    for parts in (1, 2):
        cache = _cache(parts, blocks=10, dim=2, kv_heads=1)
        cache.begin_step(torch.arange(n))
        cache.write(0, k, v, torch.arange(n))
        caches.append(cache)
    return caches[0], caches[1], k, v, torch.tensor([[1.0, 1.0]]).view(1, 1, 2)


def test_scoring_by_parts_finds_a_needle_the_whole_block_bound_ranks_below_a_decoy() -> None:
    whole, halves, k, v, q = _decoy_and_needle()
    n = k.shape[0]
    # one sink block, two window blocks and one top block
    config = SparseConfig(sinks=BS, window=2 * BS, budget=4 * BS, dense_layers=0, reselect=1)
    dense = DenseAttention(1, 1, 2)
    table = torch.arange(10)
    meta = AttentionMetadata(torch.tensor([n - 1]), 1, table[None], None, [], torch.tensor([n]))
    picks = {}
    for cache, score in ((whole, BS), (halves, BS // 2)):
        sparse = SparseAttention(dense, replace(config, score_block=score), BS)
        sel, keep = sparse.select(0, q, cache, table[None], torch.tensor([n]))
        picks[score] = sorted(set(sel[keep].tolist()) - {0, 8, 9})  # the middle block it chose
        if score < BS:
            out = sparse(0, q, k[:1], v[:1], cache, meta)
            want = dense(0, q, k[:1], v[:1], cache, meta)
            torch.testing.assert_close(out, want, atol=5e-2, rtol=0)
    assert picks == {BS: [3], BS // 2: [5]}


def test_score_blocks_that_cannot_be_kept_are_refused_with_the_reason() -> None:
    with pytest.raises(InvalidRequestError, match="must divide the 16-token KV block"):
        summary_parts(EngineConfig(attention="sparse", sparse=SparseConfig(score_block=6)), 16)
    with pytest.raises(InvalidRequestError, match="int8 cache's per-block key scales are its summaries"):
        summary_parts(
            EngineConfig(attention="sparse", kv_dtype="int8", sparse=SparseConfig(score_block=8)), 32
        )
    for tokens in (3, 0, -8):
        with pytest.raises(InvalidRequestError, match=f"--sparse-score-block {tokens} must divide"):
            summary_parts(EngineConfig(attention="sparse", sparse=SparseConfig(score_block=tokens)), 16)
    assert summary_parts(EngineConfig(attention="sparse", sparse=SparseConfig(score_block=16)), 16) == 1
    assert summary_parts(EngineConfig(attention="sparse", sparse=SparseConfig(score_block=4)), 16) == 4
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention", "sparse", "--sparse-score-block", "0"])
    assert engine_config(parser.parse_args(["--sparse-score-block", "8"])).sparse.score_block == 8
    kv = KVCache.bytes_per_token(2, 3, 64, torch.float32, 16)
    one = KVCache.bytes_per_token(2, 3, 64, torch.float32, 16, True) - kv
    assert KVCache.bytes_per_token(2, 3, 64, torch.float32, 16, True, 4) - kv == 4 * one  # four summaries


def _generate(loaded_model, kernels: str):  # type: ignore[no-untyped-def]
    """A 40-token prompt past a 3-block budget, 8 tokens greedy, blocks scored in halves."""
    sparse = SparseConfig(sinks=8, window=8, budget=24, dense_layers=2, reselect=1, score_block=BS // 2)
    core, rec = recorded_sparse_core(loaded_model, kernels, sparse, BS)
    doc = core.tokenizer.encode("The Rhine begins in the Swiss Alps and flows to the North Sea. " * 4)
    core.add_request("long", doc[:40], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    while core.has_work():
        for o in core.step():
            tokens.extend(o.token_ids)
    return tokens, rec.logits["long"]


def test_the_compiled_attention_reads_the_blocks_the_reference_scored_by_parts(loaded_model) -> None:  # type: ignore[no-untyped-def]
    if not cpu_kernels_available():
        pytest.skip("the C++ kernels serve a CPU where they could be built")
    ref_tokens, ref_logits = _generate(loaded_model, "torch")
    got_tokens, got_logits = _generate(loaded_model, "cpu")
    assert got_tokens == ref_tokens and len(got_logits) == len(ref_logits) == 8
    for a, b in zip(got_logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)
