"""KV memory per layer type (kv/layout.py): a model with sliding-window layers keeps only their
window. The layout, the pool's companion pages, the manager's whole-hit rule and the memory plan,
without a model; tests/cloud/engine/test_gemma3_engine.py runs Gemma 3 on it against transformers
and against the plain layout."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from cloud.engine.config import EngineConfig
from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.layout import PageLayout, page_layout, resident_pages
from cloud.engine.kv.manager import KVManager
from cloud.engine.kv.memory import plan_kv
from cloud.engine.request import Request
from cloud.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from cloud.model.gguf_loader import read_config
from shared.engine_types import SamplingParams

BS = 4
GEMMA = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))


def test_gemmas_layers_share_pages_of_its_three_global_layers() -> None:
    layout = page_layout(GEMMA)
    assert layout is not None
    assert (layout.num_slots, layout.num_groups, layout.window) == (3, 5, 512)
    assert [layout.groups[i] for i in (5, 11, 17)] == [-1, -1, -1]
    # every (slot, group) pair is one layer's: no two layers write the same page slot
    pairs = {(layout.slots[i], layout.groups[i]) for i in range(18)}
    assert len(pairs) == 18 and all(0 <= s < 3 for s, _ in pairs)
    assert page_layout([None] * 4) is None and page_layout([8] * 4) is None
    # an uneven count pads the last group
    odd = page_layout([None, 8, 8, None, 8])
    assert odd is not None and (odd.num_slots, odd.num_groups) == (2, 2)


def _layout(window: int) -> PageLayout:
    layout = page_layout([None, window, window])  # one global layer, two local groups of one
    assert layout is not None and layout.num_groups == 2
    return layout


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), arrival_time=0.0)


def _run(kv: KVManager, req: Request, upto: int) -> None:
    """Compute the request's tokens up to `upto`, one block-sized chunk a step."""
    while req.num_computed_tokens < upto:
        n = min(BS, upto - req.num_computed_tokens)
        assert kv.allocate(req, n)
        req.num_computed_tokens += n
        kv.register_full_blocks(req)
        kv.slide_windows(req)


def test_a_request_holds_companions_for_its_window_only_and_gives_the_rest_back() -> None:
    layout = _layout(window=8)  # two blocks of 4
    pool = BlockPool(64, groups=2)
    kv = KVManager(pool, BS, layout)
    req = _request("a", list(range(40)))
    _run(kv, req, 40)
    assert len(req.block_ids) == 10
    held = [b for b in req.block_ids if pool.blocks[b].window_refs]
    # the next query (position 40) sees positions 33..40: blocks 8 and 9 (and 10, not allocated yet)
    assert req.window_from == layout.window_start(40, BS) == 8
    assert held == req.block_ids[8:]
    assert pool.num_free == 64 - 10 - 2 * 2  # 10 global pages, two blocks' companions of 2 pages
    # each block's companion was distinct pages, recorded in the page map
    comp = pool.blocks[req.block_ids[9]].companion
    assert comp is not None and pool.page_map is not None
    assert pool.page_map[req.block_ids[9]].tolist() == list(comp)
    kv.free(req)
    assert pool.num_free == 64


def test_a_hit_ends_where_the_companions_its_next_query_reads_are_all_there() -> None:
    layout = _layout(window=8)
    pool = BlockPool(40, groups=2)
    kv = KVManager(pool, BS, layout)
    doc = list(range(100, 132))  # 8 blocks
    a = _request("a", doc)
    _run(kv, a, 32)
    ids = list(a.block_ids)
    kv.free(a)
    # every block is cached; companions of the blocks passed mid-run were released (kept cached)
    b = _request("b", [*doc, 7, 7, 7])
    hits = kv.cached_prefix(b)
    assert hits == ids  # whole: blocks 7 and 6, which position 32 reads, have companions
    # take the companion of block 7 away: a hit ending at block 8 is no longer whole; one ending
    # at block 7 needs blocks 5 and 6
    victim = pool.blocks[ids[7]]
    assert victim.companion is not None
    pool._unlink(victim.block_id)
    assert kv.cached_prefix(b) == ids[:7]
    pool._unlink(ids[5])
    assert kv.cached_prefix(b) == ids[:5]
    # admitted with the hit: it holds the companions of blocks 3 and 4 only, and computes on
    assert kv.allocate(b, BS, kv.cached_prefix(b))
    assert b.window_from == 3
    assert [bool(pool.blocks[x].window_refs) for x in b.block_ids[:5]] == [False] * 3 + [True] * 2
    b.num_computed_tokens = 5 * BS
    _run(kv, b, b.num_tokens)
    kv.free(b)
    assert pool.num_free == 40


def test_reusing_a_companion_page_unlinks_its_block_and_a_held_one_is_never_taken() -> None:
    layout = _layout(window=8)
    pool = BlockPool(12, groups=2)
    kv = KVManager(pool, BS, layout)
    a = _request("a", list(range(16)))
    _run(kv, a, 16)  # 4 global pages, companions held for blocks 2 and 3
    ids = list(a.block_ids)
    assert pool.num_free == 12 - 4 - 4
    c = _request("c", list(range(500, 508)))
    assert not kv.allocate(c, 8)  # two blocks need six pages: four are free
    assert kv.allocate(c, 4)  # three pages: the free ones first
    assert all(pool.blocks[b].companion is not None for b in ids[2:])  # held: untouched
    assert all(pool.blocks[b].companion is None for b in ids[:2])  # released ones went first
    kv.free(a)
    kv.free(c)
    assert pool.num_free == 12


def test_gemma_at_32k_keeps_over_four_times_the_tokens_in_the_same_budget(gemma_reader: Any) -> None:
    context = 32768
    model = read_config(gemma_reader)
    config = EngineConfig(dtype="float32", kv_cache_memory_gib=4.0, max_num_batched_tokens=2048)
    hybrid = plan_kv(config, model, 32768)
    plain = plan_kv(replace(config, disable_hybrid_kv_cache_manager=True), model, 32768)
    assert plain.layout is None and hybrid.layout is not None
    assert hybrid.max_model_len == plain.max_model_len == 32768  # one 32K request fits either way
    bs = config.kv_block_size

    def tokens(plan: Any) -> int:  # 32K-token requests resident at once, in tokens
        return plan.num_blocks // resident_pages(plan.layout, context, bs) * context

    assert tokens(hybrid) >= 4 * tokens(plain)
    # sparse attention keeps the layout: key summaries for the 3 global layers' pages only
    sparse = plan_kv(replace(config, attention="sparse"), model, 32768)
    assert sparse.layout is not None
    assert sparse.bytes_per_token - hybrid.bytes_per_token == 3 * 2 * 2 * model.head_dim / bs
    # a quantized cache moves whole blocks: the plain layout, whatever the model
    assert plan_kv(replace(config, kv_dtype="int8"), model, 32768).layout is None


def _most_tokens_held(groups: int, pages: int) -> tuple[int, int]:
    """Two 2000-token requests through the real scheduler and pool (the runner's part played by
    handing each finished chunk a token): the most prompt tokens running requests held at once,
    and the preemptions. Gemma's pattern: one global layer per page, windows of 512, 16-token
    blocks, 128-token chunks; `groups` 0 is the plain layout."""
    layout = page_layout(GEMMA) if groups else None
    pool = BlockPool(pages, groups=groups)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=128, max_model_len=4096), pool, 16, layout)
    for rid in ("a", "b"):
        sched.add(
            Request(
                rid,
                list(range(7, 2007)) if rid == "a" else list(range(9, 2009)),
                SamplingParams(max_tokens=24),
                arrival_time=0.0,
            )
        )
    most = 0
    while sched.num_unfinished:
        out = sched.schedule()
        sampled = {
            c.request.request_id: [1]
            for c in out.chunks
            if c.start_pos + len(c.token_ids) == c.request.num_tokens
        }
        sched.update(out, sampled)
        most = max(most, sum(r.num_computed_tokens for r in sched.running))
    assert pool.num_free == pages
    return most, sched.num_preemptions


def test_one_budget_runs_two_long_requests_at_once_where_every_layer_held_one() -> None:
    # the budget of one 2024-token request with every layer's KV: 127 blocks of 18 layers, which
    # are 762 pages of the 3 global layers
    plain, _ = _most_tokens_held(0, 127)
    windows, preempted = _most_tokens_held(5, 127 * 6)
    assert plain <= 127 * 16
    assert windows >= 2 * 2000 and preempted == 0  # the first decodes while the second prefills


def test_key_summaries_follow_the_global_layers_pages_and_local_layers_keep_none() -> None:
    """Sparse attention over a page layout: a global layer's block summaries are the min / max of
    the keys written to its page, whichever storage slot the layer has; a local layer's writes (to
    companion pages) touch no summary, and it has none to read."""
    layout = page_layout([8, None, 8, None])  # slots: global layers 1 and 3 -> 0 and 1
    assert layout is not None
    cache = KVCache(4, 12, BS, 2, 8, torch.float32, track_summaries=True, layout=layout)
    assert cache.summaries is not None and len(cache.summaries.kmin) == 2
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([5 * BS + 1, 5 * BS + 2, 7 * BS])  # blocks 5 and 7
    keys = {layer: torch.randn(3, 2, 8, generator=g) for layer in range(4)}
    for layer in range(4):
        cache.begin_step(slots)
        cache.write(layer, keys[layer], keys[layer], slots)
    for layer in (1, 3):
        kmin, kmax = cache.key_bounds(layer)
        k = keys[layer].half()
        torch.testing.assert_close(kmin[:, 5], k[:2].amin(0))
        torch.testing.assert_close(kmax[:, 5], k[:2].amax(0))
        torch.testing.assert_close(kmax[:, 7], k[2])
        assert bool(kmin[:, 6].isinf().all())  # never written
    with pytest.raises(RuntimeError, match="layer 2 attends to its window"):
        cache.key_bounds(2)
