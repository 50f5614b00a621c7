"""KV pruning by attention (kv/prune.py, `--kv-prune-budget`): the selection against plain loops, the
scheduler's block trade, and the real model decoding over its pruned cache exactly as a reference
that attends, per layer and KV head, to the kept tokens only."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from cloud.bench.longctx_data import CaseSpec, Encoder, is_correct, make_case
from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.prune import compact, observation_scores, select_kept
from cloud.engine.kv.prune_plan import OBSERVATION_WINDOW, POOL_KERNEL, SINK_TOKENS, PruneLimit, PruneOrder
from cloud.engine.request import Request
from cloud.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from shared.engine_types import SamplingParams
from shared.errors import ContextLengthExceededError, InvalidRequestError
from tests.cloud.engine.recording import RecordingSampler

W, SINKS = OBSERVATION_WINDOW, SINK_TOKENS


# -- the selection, against plain loops ------------------------------------------------------


def _plain_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    w, h, _ = q.shape
    kvh, p, _ = k.shape
    out = torch.zeros(kvh, p, dtype=torch.float64)
    for head in range(h):
        kv = head // (h // kvh)
        for i in range(w):
            seen = p - w + i + 1  # the window's query i sits at position p - w + i
            logits = [float(q[i, head].double() @ k[kv, j].double()) * scale for j in range(seen)]
            probs = torch.tensor(logits, dtype=torch.float64).softmax(0)
            out[kv, :seen] += probs
    return out


def _plain_select(scores: torch.Tensor, num_kept: int) -> list[list[int]]:
    kept = []
    for row in scores.tolist():
        p = len(row)
        half = POOL_KERNEL // 2
        pooled = [max(row[max(0, j - half) : min(p - W, j + half + 1)]) for j in range(p - W)]
        candidates = sorted(range(SINKS, p - W), key=lambda j: (-pooled[j], j))
        chosen = candidates[: num_kept - SINKS - W]
        kept.append(sorted([*range(SINKS), *chosen, *range(p - W, p)]))
    return kept


def test_observation_scores_are_the_windows_softmax_summed_over_queries_and_query_groups() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(W, 6, 8, generator=g), torch.randn(2, 50, 8, generator=g)
    got = observation_scores(q, k, 8**-0.5)
    torch.testing.assert_close(got.double(), _plain_scores(q, k, 8**-0.5), atol=1e-5, rtol=1e-5)
    # each query's softmax sums to one: W queries x 3 query heads per KV head
    torch.testing.assert_close(got.sum(1), torch.full((2,), 3.0 * W))


@pytest.mark.parametrize("num_kept", [SINKS + W, SINKS + W + 5, 70])
def test_selection_keeps_sinks_window_and_the_best_pooled_scores_per_head(num_kept: int) -> None:
    g = torch.Generator().manual_seed(num_kept)
    scores = torch.rand(3, 90, generator=g)
    scores[1, 40:45] = 0.5  # a plateau: ties go to the earlier position
    kept = select_kept(scores, num_kept)
    assert kept.shape == (3, num_kept)  # the same count for every head
    assert kept.tolist() == _plain_select(scores, num_kept)
    for row in kept.tolist():  # sinks and window whatever their scores
        assert set(range(SINKS)) | set(range(90 - W, 90)) <= set(row)
    if num_kept > SINKS + W:
        assert len({tuple(r) for r in kept.tolist()}) == 3  # each head its own choice


def test_selection_refuses_a_count_below_sinks_and_window() -> None:
    with pytest.raises(ValueError, match="cannot keep"):
        select_kept(torch.rand(1, 90), SINKS + W - 1)


def test_compact_copies_each_heads_kept_tokens_into_fresh_blocks_and_leaves_the_prompts() -> None:
    bs, kvh, d, p = 4, 2, 8, 50
    g = torch.Generator().manual_seed(3)
    cache = KVCache(2, 32, bs, kvh, d, torch.float32)
    old = list(range(13, 0, -1))  # 13 blocks for 50 tokens, out of order
    slots = torch.tensor([old[i // bs] * bs + i % bs for i in range(p)])
    keys, values = [], []
    for layer in range(2):
        k, v = torch.randn(p, kvh, d, generator=g), torch.randn(p, kvh, d, generator=g)
        cache.write(layer, k, v, slots)
        keys.append(k)
        values.append(v)
    before = [t.clone() for t in cache.k]
    queries = [torch.randn(W, 4, d, generator=g) for _ in range(2)]
    order = PruneOrder("r", old, [20, 25, 21, 30, 22, 23, 24, 26, 27, 28], p, 38)
    compact(cache, order, queries, d**-0.5)
    for layer in range(2):
        index = select_kept(observation_scores(queries[layer], keys[layer].transpose(0, 1), d**-0.5), 38)
        j = torch.arange(38)
        new_slots = torch.tensor(order.new_blocks)[j // bs] * bs + j % bs
        for h in range(kvh):
            torch.testing.assert_close(cache.k[layer][h, new_slots], keys[layer][index[h], h])
            torch.testing.assert_close(cache.v[layer][h, new_slots], values[layer][index[h], h])
        torch.testing.assert_close(cache.k[layer][:, slots], before[layer][:, slots])  # prompt's intact


# -- the scheduler's block trade -------------------------------------------------------------

BS = 4
BUDGET = SINKS + W + 2 * BS  # 44


def _drive(s: Scheduler, steps: int) -> list:  # type: ignore[type-arg]
    outs = []
    for _ in range(steps):
        out = s.schedule()
        s.update(out, {c.request_id: [7] for c in out.chunks if c.sample})
        outs.append(out)
    return outs


def test_a_pruned_prompt_trades_its_blocks_for_fresh_ones_and_stays_cached() -> None:
    pool = BlockPool(40)
    s = Scheduler(SchedulerConfig(4, 32, 8, 200, prune_budget=BUDGET), pool, BS)
    r = Request("r", list(range(100, 170)), SamplingParams(max_tokens=5))  # 70 tokens: 18 blocks
    s.add(r)
    prefill = _drive(s, 3)  # 32 + 32 + 6 tokens: the last chunk samples the first token
    assert [len(o.chunks[0].token_ids) for o in prefill] == [32, 32, 6] and not any(o.prunes for o in prefill)
    prompt_blocks = list(r.block_ids)
    assert prompt_blocks == list(range(18))
    out = s.schedule()
    # D = ceil((70 - 44) / 4) = 7 blocks given up; K = 70 - 28 = 42 kept, in 11 fresh blocks
    (order,) = out.prunes
    assert (order.old_blocks, order.num_prompt_tokens, order.num_kept) == (prompt_blocks, 70, 42)
    assert order.new_blocks == list(range(18, 29))
    assert r.block_ids == [-1] * 7 + order.new_blocks and r.pruned
    assert out.chunks[0].block_ids == r.block_ids and out.chunks[0].start_pos == 70
    # the prompt's full blocks are free but still cached; the request holds only the kept ones
    assert pool.num_free == 40 - 11
    cached_before = dict(pool.cached)
    assert sorted(cached_before.values()) == list(range(17))  # 17 full prompt blocks
    s.update(out, {"r": [7]})
    _drive(s, 4)  # decodes to the end: its blocks never enter the prefix cache
    assert r.is_finished and pool.cached == cached_before and pool.num_free == 40


def test_a_preempted_pruned_request_recomputes_its_prompt_prunes_again_then_its_outputs() -> None:
    pool = BlockPool(40)
    s = Scheduler(SchedulerConfig(4, 64, 8, 200, prune_budget=BUDGET), pool, BS)
    r = Request("r", list(range(100, 170)), SamplingParams(max_tokens=20))
    s.add(r)
    _drive(s, 2)  # 64 + 6 tokens, sampled
    _drive(s, 3)  # prune, then 3 decode steps
    assert r.pruned and len(r.output_token_ids) == 4
    s._preempt(r)  # as the running loop does when the pool runs dry
    assert not r.pruned and r.block_ids == [] and pool.num_free == 40
    out = s.schedule()
    # the prompt's cached blocks serve up to the observation window (70 - 32 = 38: 9 blocks), and
    # the chunk stops at the prompt's end: its outputs wait for the pruned cache
    (chunk,) = out.chunks
    assert (chunk.start_pos, len(chunk.token_ids), chunk.sample) == (36, 34, False)
    assert chunk.block_ids[:9] == list(range(9)) and not out.prunes
    s.update(out, {})
    out = s.schedule()
    (order,) = out.prunes
    (chunk,) = out.chunks
    assert (chunk.start_pos, len(chunk.token_ids), chunk.sample) == (70, 4, True)
    assert r.block_ids[:18] == [-1] * 7 + order.new_blocks  # then a block for the outputs


def test_a_prompt_whose_peak_exceeds_the_pool_is_refused_and_a_waiting_one_waits_for_its_peak() -> None:
    PruneLimit(BUDGET, BS, 29).check(70)  # 18 prompt blocks + 11 kept: 29 at its peak
    PruneLimit(BUDGET, BS, 1).check(BUDGET)  # not pruned: the context checks alone apply
    with pytest.raises(ContextLengthExceededError, match="needs room for its KV and its kept tokens'"):
        PruneLimit(BUDGET, BS, 28).check(70)
    pool = BlockPool(30)
    s = Scheduler(SchedulerConfig(4, 64, 8, 200, prune_budget=BUDGET), pool, BS)
    s.add(Request("short", list(range(8)), SamplingParams(max_tokens=10)))  # 2 blocks, then 3
    s.add(Request("long", list(range(100, 170)), SamplingParams(max_tokens=5)))
    first = _drive(s, 1)[0]
    # 28 blocks free: the long prompt would fit (18) but not at its peak (29); it waits
    assert [c.request_id for c in first.chunks] == ["short"]
    assert s.requests["long"].block_ids == []
    _drive(s, 12)
    assert s.requests["long"].pruned  # admitted once the short request had finished


# -- the real model ----------------------------------------------------------------------------

BASE = EngineConfig(dtype="float32", weight_quant="none", kv_cache_memory_gib=0.05, max_model_len=1024)
FILL = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def _passkey(core: EngineCore, key: int, depth: float, repeats: int = 10) -> list[int]:
    at = int(repeats * depth)
    text = (
        "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
        + FILL * at
        + f"The pass key is {key}. Remember it. {key} is the pass key. "
        + FILL * (repeats - at)
        + "What is the pass key?"
    )
    return core.encode_chat([{"role": "user", "content": text}])


def _generate(core: EngineCore, rid: str, ids: list[int], max_tokens: int) -> list[int]:
    core.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens = []
    while core.has_work():
        tokens += [t for o in core.step() for t in o.token_ids]
    return tokens


def test_a_budget_covering_the_prompt_changes_nothing(loaded_model) -> None:  # type: ignore[no-untyped-def]
    core = EngineCore(BASE, loaded_model)
    ids = _passkey(core, 51902, 0.5, repeats=3)
    want = _generate(core, "dense", ids, 6)
    covered = EngineCore(replace(BASE, kv_prune_budget=len(ids), enable_prefix_caching=False), loaded_model)
    assert _generate(covered, "covered", ids, 6) == want


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"kv_dtype": "int8"}, "full-precision"),
        ({"attention": "sparse"}, "dense attention"),
        ({"context_overflow": "sliding_window"}, "sliding_window"),
        ({"kv_prune_budget": 40}, "below 52"),
    ],
)
def test_what_pruning_cannot_serve_is_refused_at_start(loaded_model, change, reason) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError, match=reason):
        EngineCore(replace(replace(BASE, kv_prune_budget=128), **change), loaded_model)


class _Reference:
    """The model's own forward with attention done here, densely over a prompt, then for each later
    token per layer and KV head over the kept prompt tokens (selected by kv/prune.py's functions
    from the window's queries) and the tokens after the prompt."""

    def __init__(self, core: EngineCore) -> None:
        self.model = core.model
        c = self.model.config
        self.group, self.scale = c.num_heads // c.num_kv_heads, c.head_dim**-0.5
        self.k: list[torch.Tensor] = []  # per layer [kv_heads, tokens, d], the prompt's then later
        self.v: list[torch.Tensor] = []
        self.kept: list[torch.Tensor] = []  # per layer [kv_heads, K]
        self.prompt_len = 0

    def prompt(self, ids: list[int], num_kept: int) -> torch.Tensor:
        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kh, vh = k.transpose(0, 1), v.transpose(0, 1)
            self.k.append(kh)
            self.v.append(vh)
            self.kept.append(select_kept(observation_scores(q[-W:], kh, self.scale), num_kept))
            o = F.scaled_dot_product_attention(q.transpose(0, 1), kh, vh, is_causal=True, enable_gqa=True)
            return o.transpose(0, 1)

        return self._run(ids, 0, attend)

    def token(self, token: int, position: int) -> torch.Tensor:
        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k[layer] = torch.cat([self.k[layer], k.transpose(0, 1)], 1)
            self.v[layer] = torch.cat([self.v[layer], v.transpose(0, 1)], 1)
            out = torch.empty_like(q)
            for h in range(q.shape[1]):
                kv = h // self.group
                later = torch.arange(self.prompt_len, self.k[layer].shape[1])
                rows = torch.cat([self.kept[layer][kv], later])
                keys, values = self.k[layer][kv, rows], self.v[layer][kv, rows]
                weights = ((keys @ q[0, h]) * self.scale).softmax(0)
                out[0, h] = weights @ values
            return out

        return self._run([token], position, attend)

    def _run(self, ids: list[int], start: int, attend) -> torch.Tensor:  # type: ignore[no-untyped-def]
        n = len(ids)
        if start == 0:
            self.prompt_len = n
        positions = torch.arange(start, start + n)
        return self.model.forward(torch.tensor(ids), positions, attend, torch.tensor([n - 1]))[0]


PRUNED = replace(BASE, kv_prune_budget=96)


@pytest.fixture(scope="module")
def pruned(loaded_model) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(PRUNED, loaded_model)


def _kept(p: int) -> int:
    return p - -(-(p - 96) // 16) * 16


def test_decoding_over_the_pruned_cache_is_attention_to_the_kept_tokens_only(pruned) -> None:  # type: ignore[no-untyped-def]
    core = pruned
    rec = RecordingSampler()
    core.runner.sampler = rec
    ids = _passkey(core, 30377, 0.8, repeats=2)
    p, kept = len(ids), _kept(len(ids))
    assert p > 96
    tokens = _generate(core, "r", ids, 4)
    ref = _Reference(core)
    want = [ref.prompt(ids, kept)]
    for i, t in enumerate(tokens[:-1]):
        want.append(ref.token(t, p + i))
    for i, (got, logits) in enumerate(zip(rec.logits["r"], want, strict=True)):
        diff = (got - logits).abs().max().item()
        assert diff < 2e-3, f"step {i}: max |logit diff| {diff}"


def test_a_pruned_request_holds_its_budget_and_leaves_its_prompt_cached(pruned) -> None:  # type: ignore[no-untyped-def]
    core = pruned
    ids = _passkey(core, 77291, 0.5, repeats=3)
    p = len(ids)
    core.add_request("first", ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    held = []
    while core.has_work():
        outs = core.step()
        req = core.scheduler.requests.get("first")
        if req is not None:
            held.append(sum(1 for b in req.block_ids if b >= 0))
    assert [o.num_prompt_tokens for o in outs] == [p]  # usage counts the real prompt
    # the whole prompt while it prefills, then the kept tokens and the first output's
    assert held == [-(-p // 16), -(-(_kept(p) + 1) // 16)]
    assert core.pool.num_free == core.pool.num_blocks
    hits = core.scheduler.prefix_hit_tokens
    tokens = _generate(core, "second", ids, 3)
    # every prompt block before the observation window (whose queries are computed again) is a hit
    assert core.scheduler.prefix_hit_tokens - hits == (p - W) // 16 * 16
    assert len(tokens) == 3


def test_a_passkey_survives_pruning_to_half_the_prompt(loaded_model) -> None:  # type: ignore[no-untyped-def]
    core = EngineCore(replace(BASE, kv_prune_budget=122), loaded_model)
    enc = Encoder(core.encode_chat, core.tokenizer)
    for depth in (25, 50, 75):
        case = make_case(CaseSpec("passkey", 256, depth), enc, 12, 0)
        assert len(case.prompt_ids) // 2 == 122
        answer = core.tokenizer.decode(_generate(core, f"key{depth}", list(case.prompt_ids), 8))
        assert is_correct(case, answer), f"depth {depth}: {answer!r}"


def test_a_pruned_request_preempted_by_a_higher_priority_one_recomputes_to_the_same_logits(
    loaded_model, pruned
) -> None:  # type: ignore[no-untyped-def]
    ids = _passkey(pruned, 24680, 0.3, repeats=2)
    alone = RecordingSampler()
    pruned.runner.sampler = alone
    want = _generate(pruned, "alone", ids, 60)
    # a pool that holds the prompt at its peak (its blocks and the kept ones): after pruning, a short
    # high-priority request fits beside it, and the two outgrow the pool while decoding
    blocks = PruneLimit(96, 16, 0).peak_blocks(len(ids))
    c = loaded_model.weights.config
    gib = (
        blocks * 16 * KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32) / 2**30
    )
    core = EngineCore(replace(PRUNED, kv_cache_memory_gib=gib, max_model_len=blocks * 16), loaded_model)
    rec = RecordingSampler()
    core.runner.sampler = rec
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    core.add_request("a", ids, params, priority=1)
    tokens = [t for _ in range(2) for o in core.step() for t in o.token_ids]  # prefill, then pruned
    core.add_request("b", core.encode_chat([{"role": "user", "content": "Hi"}]), params, priority=0)
    while core.has_work():
        tokens += [t for o in core.step() if o.request_id == "a" for t in o.token_ids]
    assert core.scheduler.num_preemptions >= 1 and core.pool.num_free == core.pool.num_blocks
    assert tokens == want
    for i, (got, ref) in enumerate(zip(rec.logits["a"], alone.logits["alone"], strict=True)):
        assert (got - ref).abs().max().item() < 1e-3, f"token {i}"
