"""The scheduler on tiny configs (scheduler_sim.py): prefill and chunk plans, prefix-cache hits and
admission order, with exact block ids."""

from __future__ import annotations

import pytest

from cloud.engine.request import FinishReason, Request, RequestStatus
from shared.engine_types import SamplingParams
from shared.errors import QueueFullError

from .scheduler_sim import TOKEN, events, make, plan, ref_counts, req, step

# -- prefill, chunking, interleaving ---------------------------------------------------------------


def test_prompt_is_computed_in_one_step_into_exact_blocks() -> None:
    s, pool = make()
    a = req("a", list(range(10, 16)))
    s.add(a)
    out, evs = step(s, {"a": 7})
    assert plan(out) == [("a", 0, 6, True)]
    assert out.chunks[0].token_ids == list(range(10, 16))
    assert out.chunks[0].block_ids == [0, 1]
    assert out.preempted == []
    assert events(evs) == [("a", 7, None)]
    assert a.block_ids == [0, 1]
    assert a.num_computed_tokens == 6
    assert a.token_ids == [*range(10, 16), 7]
    assert a.status is RequestStatus.RUNNING
    assert ref_counts(pool) == [1, 1, 0, 0, 0, 0, 0, 0]


def test_chunked_prefill_computes_4_4_2_and_samples_only_after_the_last_chunk() -> None:
    s, _ = make(budget=4)
    prompt = list(range(20, 30))
    a = req("a", prompt)
    s.add(a)

    out, evs = step(s)
    assert plan(out) == [("a", 0, 4, False)]
    assert out.chunks[0].token_ids == prompt[0:4]
    assert out.chunks[0].block_ids == [0]
    assert evs == []
    assert a.num_computed_tokens == 4

    out, evs = step(s)
    assert plan(out) == [("a", 4, 4, False)]
    assert out.chunks[0].token_ids == prompt[4:8]
    assert out.chunks[0].block_ids == [0, 1]
    assert evs == []
    assert a.num_computed_tokens == 8

    out, evs = step(s, {"a": 5})
    assert plan(out) == [("a", 8, 2, True)]
    assert out.chunks[0].token_ids == prompt[8:10]
    assert out.chunks[0].block_ids == [0, 1, 2]
    assert events(evs) == [("a", 5, None)]
    assert a.num_computed_tokens == 10
    assert a.token_ids == [*prompt, 5]


def test_decode_interleaves_with_another_requests_prefill_chunks() -> None:
    s, _ = make(budget=4)
    a = req("a", [1, 2, 3], t=0)
    s.add(a)
    out, _ = step(s, {"a": 40})
    assert plan(out) == [("a", 0, 3, True)]

    b = req("b", list(range(50, 58)), t=1)
    s.add(b)
    out, evs = step(s, {"a": 41})
    assert plan(out) == [("a", 3, 1, True), ("b", 0, 3, False)]
    assert out.chunks[0].token_ids == [40]
    assert events(evs) == [("a", 41, None)]
    assert (a.block_ids, b.block_ids) == ([0], [1])

    out, evs = step(s, {"a": 42})
    assert plan(out) == [("a", 4, 1, True), ("b", 3, 3, False)]
    assert out.chunks[0].token_ids == [41]
    assert (a.block_ids, b.block_ids) == ([0, 2], [1, 3])

    out, evs = step(s, {"a": 43, "b": 60})
    assert plan(out) == [("a", 5, 1, True), ("b", 6, 2, True)]
    assert out.chunks[1].token_ids == [56, 57]
    assert events(evs) == [("a", 43, None), ("b", 60, None)]
    assert (a.block_ids, b.block_ids) == ([0, 2], [1, 3])
    assert a.token_ids == [1, 2, 3, 40, 41, 42, 43]
    assert b.token_ids == [*range(50, 58), 60]


def test_a_long_prefill_alone_takes_the_whole_budget_even_with_a_cap() -> None:
    s, _ = make(budget=8, num_blocks=16, long_prefill=4)
    s.add(req("long", list(range(100, 120))))
    out, _ = step(s)
    assert plan(out) == [("long", 0, 8, False)]


def test_a_capped_long_prefill_lets_a_short_prompt_start_in_the_same_step() -> None:
    s, _ = make(budget=8, num_blocks=16, long_prefill=4)
    long, short = req("long", list(range(100, 120)), t=0), req("short", [1, 2, 3], t=1)
    s.add(long)
    out, _ = step(s)
    assert plan(out) == [("long", 0, 8, False)]  # alone: uncapped
    s.add(short)
    out, evs = step(s, {"short": 7})
    assert plan(out) == [("long", 8, 4, False), ("short", 0, 3, True)]  # the short one's first token now
    assert events(evs) == [("short", 7, None)]
    out, _ = step(s)
    assert plan(out) == [("long", 12, 4, False), ("short", 3, 1, True)]  # it decodes alongside
    out, _ = step(s)
    assert plan(out) == [("long", 16, 4, True), ("short", 4, 1, True)]
    assert long.num_computed_tokens == 20 and len(long.token_ids) == 21


def test_without_a_cap_a_long_prefill_holds_the_step_and_the_short_prompt_waits() -> None:
    s, _ = make(budget=8, num_blocks=16)
    long, short = req("long", list(range(100, 124)), t=0), req("short", [1, 2, 3], t=1)
    s.add(long)
    step(s)
    s.add(short)
    out, _ = step(s)
    assert plan(out) == [("long", 8, 8, False)]  # the whole budget: "short" waits for the next step


# -- prefix cache --------------------------------------------------------------------------------


def test_shared_prompt_prefix_reuses_full_blocks() -> None:
    s, pool = make()
    a = req("a", list(range(10)), t=0)
    s.add(a)
    step(s)
    assert a.block_ids == [0, 1, 2]
    assert a.num_cached_tokens == 0

    b = req("b", [*range(8), 50, 51, 52], t=1)
    s.add(b)
    out, _ = step(s)
    assert plan(out) == [("a", 10, 1, True), ("b", 8, 3, True)]
    assert out.chunks[1].token_ids == [50, 51, 52]
    assert b.num_cached_tokens == 8
    assert b.block_ids == [0, 1, 3]
    assert ref_counts(pool)[:4] == [2, 2, 1, 1]
    assert s.prefix_queried_tokens == 10 + 11
    assert s.prefix_hit_tokens == 8


def test_fully_cached_prompt_still_recomputes_its_last_block() -> None:
    s, pool = make()
    a = req("a", list(range(8)), max_tokens=1, t=0)
    s.add(a)
    _, evs = step(s)
    assert events(evs) == [("a", TOKEN, FinishReason.LENGTH)]
    assert pool.num_free == 8  # a is gone, its two blocks still cache the prompt

    b = req("b", list(range(8)), t=1)
    s.add(b)
    out, _ = step(s)
    # both blocks are cached, but the last one is recomputed: that step yields the logits to sample
    assert plan(out) == [("b", 4, 4, True)]
    assert b.num_cached_tokens == 4
    assert b.block_ids == [0, 2]


def test_a_one_block_prompt_gets_no_prefix_hit() -> None:
    s, _ = make()
    s.add(req("a", [1, 2, 3, 4], max_tokens=1, t=0))
    step(s)
    b = req("b", [1, 2, 3, 4], t=1)
    s.add(b)
    out, _ = step(s)
    assert plan(out) == [("b", 0, 4, True)]
    assert b.num_cached_tokens == 0


def test_extra_key_separates_otherwise_equal_prefixes() -> None:
    s, _ = make()
    s.add(req("a", list(range(9)), max_tokens=1, t=0))
    step(s)
    b = Request("b", list(range(9)), SamplingParams(), extra_key=b"adapter", arrival_time=1)
    s.add(b)
    out, _ = step(s)
    assert plan(out) == [("b", 0, 9, True)]
    assert b.num_cached_tokens == 0


def test_decoded_tokens_fill_blocks_that_enter_the_prefix_cache() -> None:
    s, pool = make()
    a = req("a", [0, 1, 2, 3, 4, 5], max_tokens=3, t=0)
    s.add(a)
    step(s, {"a": 6})
    step(s, {"a": 7})  # block 1 fills up with prompt tokens 4, 5 and decoded tokens 6, 7
    step(s, {"a": 8})
    assert a.is_finished
    assert a.finish_reason is FinishReason.LENGTH
    assert pool.blocks[1].block_hash is not None

    b = req("b", [0, 1, 2, 3, 4, 5, 6, 7, 9], t=1)
    s.add(b)
    out, _ = step(s)
    assert plan(out) == [("b", 8, 1, True)]
    assert b.num_cached_tokens == 8
    assert b.block_ids == [0, 1, 2]


# -- admission -----------------------------------------------------------------------------------


def test_waiting_requests_run_by_priority_then_arrival() -> None:
    s, _ = make(max_num_seqs=1)
    s.add(req("c", [1], max_tokens=1, priority=1, t=0))
    s.add(req("a", [2], max_tokens=1, priority=0, t=2))
    s.add(req("b", [3], max_tokens=1, priority=0, t=1))
    s.add(req("d", [4], max_tokens=1, priority=0, t=1))  # same arrival as b: submission order
    s.add(req("e", [5], max_tokens=1, priority=-1, t=3))
    assert [r.request_id for r in s.waiting] == ["e", "b", "d", "a", "c"]
    order = []
    while s.num_unfinished:
        out, evs = step(s)
        assert len(out.chunks) == 1
        order += [e.request.request_id for e in evs]
    assert order == ["e", "b", "d", "a", "c"]


def test_bounded_waiting_queue_raises_queue_full() -> None:
    s, _ = make(max_waiting=2)
    s.add(req("a", [1], t=0))
    s.add(req("b", [2], t=1))
    with pytest.raises(QueueFullError):
        s.add(req("c", [3], t=2))
    assert [r.request_id for r in s.waiting] == ["a", "b"]
    assert s.num_unfinished == 2
    step(s)
    s.add(req("c", [3], t=2))  # admission made room
    with pytest.raises(ValueError, match="duplicate"):
        s.add(req("c", [3], t=3))


def test_max_num_seqs_bounds_running_requests() -> None:
    s, _ = make(max_num_seqs=2)
    for i, rid in enumerate("abc"):
        s.add(req(rid, [i + 1], max_tokens=2, t=i))
    out, _ = step(s)
    assert plan(out) == [("a", 0, 1, True), ("b", 0, 1, True)]
    assert [r.request_id for r in s.waiting] == ["c"]
    out, evs = step(s)
    assert plan(out) == [("a", 1, 1, True), ("b", 1, 1, True)]
    assert [e.finish for e in evs] == [FinishReason.LENGTH, FinishReason.LENGTH]
    out, _ = step(s)
    assert plan(out) == [("c", 0, 1, True)]


def test_head_of_queue_that_does_not_fit_holds_back_later_requests() -> None:
    s, _ = make(num_blocks=3)
    s.add(req("a", list(range(8)), t=0))
    step(s)
    s.add(req("big", list(range(20, 28)), t=1))  # needs 2 blocks, 1 is free
    s.add(req("small", [30], t=2))  # would fit, but must not overtake
    out, _ = step(s)
    assert plan(out) == [("a", 8, 1, True)]
    assert [r.request_id for r in s.waiting] == ["big", "small"]
