"""The scheduler on tiny configs (scheduler_sim.py) across a request's life: preemption and resume,
finishing (abort, length, stop) and n > 1 siblings sharing a prompt, with exact block ids."""

from __future__ import annotations

from cloud.engine.request import FinishReason, RequestStatus
from shared.block_hash import hash_block

from .scheduler_sim import TOKEN, events, make, plan, ref_counts, req, run_to_end, step

# -- preemption ----------------------------------------------------------------------------------


def test_preemption_frees_the_latest_arrival_which_later_resumes_from_the_cache() -> None:
    s, pool = make(num_blocks=4)
    a = req("a", list(range(0, 7)), max_tokens=4, t=0)
    b = req("b", list(range(10, 17)), max_tokens=4, t=1)
    s.add(a)
    s.add(b)
    out, _ = step(s, {"a": 100, "b": 200})
    assert plan(out) == [("a", 0, 7, True), ("b", 0, 7, True)]
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3])
    out, _ = step(s, {"a": 101, "b": 201})
    assert plan(out) == [("a", 7, 1, True), ("b", 7, 1, True)]  # both fill their second block

    c = req("c", list(range(30, 37)), max_tokens=2, t=2)
    s.add(c)
    # a needs a third block, none is free: b arrived later, so b goes
    out, evs = step(s, {"a": 102})
    assert out.preempted == ["b"]
    assert plan(out) == [("a", 8, 1, True)]
    assert events(evs) == [("a", 102, None)]
    assert b.status is RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.block_ids == []
    assert b.num_preemptions == 1
    assert b.token_ids == [*range(10, 17), 200, 201]  # its sampled tokens stay
    assert a.block_ids == [0, 1, 3]  # b's tail block (freed first) was evicted for a
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # b keeps its place by arrival
    assert [r.request_id for r in s.running] == ["a"]
    assert ref_counts(pool) == [1, 1, 0, 1]

    out, evs = step(s, {"a": 103})
    assert plan(out) == [("a", 9, 1, True)]  # b does not fit yet, and c waits behind it
    assert events(evs) == [("a", 103, FinishReason.LENGTH)]
    assert pool.num_free == 4

    out, evs = step(s, {"b": 202})
    # b's first block survived in the cache; it recomputes the rest, including its sampled tokens
    assert plan(out) == [("b", 4, 5, True)]
    assert out.chunks[0].token_ids == [14, 15, 16, 200, 201]
    assert b.block_ids == [2, 3, 1]
    assert b.num_cached_tokens == 0  # counted at first admission only
    assert events(evs) == [("b", 202, None)]
    assert [r.request_id for r in s.waiting] == ["c"]
    run_to_end(s)
    assert b.output_token_ids == [200, 201, 202, TOKEN]
    assert pool.num_free == 4


def test_preempted_request_resumes_wholly_from_cache_when_its_blocks_survive() -> None:
    s, pool = make(num_blocks=5, budget=32)
    a = req("a", list(range(0, 8)), max_tokens=2, t=0)
    b = req("b", list(range(10, 19)), max_tokens=8, t=1)
    s.add(a)
    s.add(b)
    step(s)
    assert (a.block_ids, b.block_ids) == ([0, 1], [2, 3, 4])
    # a's decode needs a third block: b is preempted, its blocks queue tail first (4, 3, 2)
    out, evs = step(s)
    assert out.preempted == ["b"]
    assert out.chunks[0].block_ids == [0, 1, 4]
    assert events(evs) == [("a", TOKEN, FinishReason.LENGTH)]  # a is done: free queue 3, 2, 4, 1, 0
    out, _ = step(s)
    # b's two full blocks are still cached; only its partial tail (prompt token 18, then its sampled
    # token) is recomputed, into the block at the head of the free queue
    assert plan(out) == [("b", 8, 2, True)]
    assert out.chunks[0].token_ids == [18, TOKEN]
    assert b.block_ids == [2, 3, 4]
    assert pool.lookup(hash_block(None, [0, 1, 2, 3])) == 0  # a's prompt blocks stay cached


def test_preemption_takes_the_lower_priority_request_even_if_admitted_first() -> None:
    s, _ = make(num_blocks=4)
    low = req("low", list(range(0, 7)), priority=1, t=0)
    s.add(low)
    step(s)
    high = req("high", list(range(10, 17)), priority=0, t=1)
    s.add(high)
    step(s)
    assert [r.request_id for r in s.running] == ["low", "high"]
    assert (low.block_ids, high.block_ids) == ([0, 1], [2, 3])
    out, _ = step(s)  # low needs a third block: it is the one served last, so it yields
    assert out.preempted == ["low"]
    assert plan(out) == [("high", 7, 1, True)]
    assert low.num_computed_tokens == 0
    assert [r.request_id for r in s.running] == ["high"]


# -- finishing -----------------------------------------------------------------------------------


def test_finish_aborts_a_running_request_and_frees_its_blocks_at_once() -> None:
    s, pool = make()
    a = req("a", list(range(6)), t=0)
    s.add(a)
    step(s)
    assert a.block_ids == [0, 1]
    assert s.finish("a", FinishReason.ABORT) is a
    assert a.status is RequestStatus.FINISHED
    assert a.finish_reason is FinishReason.ABORT
    assert a.block_ids == []
    assert s.running == []
    assert s.num_unfinished == 0
    assert pool.num_free == 8
    assert ref_counts(pool) == [0] * 8
    assert s.finish("a", FinishReason.ABORT) is None
    assert s.finish("nope", FinishReason.ABORT) is None


def test_finish_removes_a_waiting_request() -> None:
    s, _ = make()
    s.add(req("a", [1], t=0))
    s.finish("a", FinishReason.ABORT)
    assert s.waiting == []
    out, _ = step(s)
    assert out.chunks == []


def test_abort_while_the_step_runs_drops_its_result() -> None:
    s, pool = make()
    s.add(req("a", list(range(5)), t=0))
    s.add(req("b", list(range(10, 15)), t=1))
    out = s.schedule()
    s.finish("a", FinishReason.ABORT)
    evs = s.update(out, {"a": [1], "b": [2]})
    assert events(evs) == [("b", 2, None)]
    assert pool.num_free == 6


def test_max_tokens_finishes_with_length_and_frees_blocks() -> None:
    s, pool = make()
    a = req("a", list(range(5)), max_tokens=3)
    s.add(a)
    got = []
    for tok in (11, 12, 13):
        _, evs = step(s, {"a": tok})
        got += events(evs)
    assert got == [("a", 11, None), ("a", 12, None), ("a", 13, FinishReason.LENGTH)]
    assert a.output_token_ids == [11, 12, 13]
    assert a.finish_reason is FinishReason.LENGTH
    assert s.num_unfinished == 0
    assert pool.num_free == 8


def test_max_model_len_finishes_with_length() -> None:
    s, _ = make(max_model_len=7)
    a = req("a", list(range(5)), max_tokens=10)
    s.add(a)
    _, evs = step(s)
    assert events(evs) == [("a", TOKEN, None)]
    _, evs = step(s)
    assert events(evs) == [("a", TOKEN, FinishReason.LENGTH)]
    assert a.num_tokens == 7


def test_eos_finishes_with_stop() -> None:
    s, pool = make()
    a = req("a", list(range(5)), max_tokens=10, eos=frozenset({2}))
    s.add(a)
    _, evs = step(s, {"a": 5})
    assert events(evs) == [("a", 5, None)]
    _, evs = step(s, {"a": 2})
    assert events(evs) == [("a", 2, FinishReason.STOP)]
    assert a.finish_reason is FinishReason.STOP
    assert a.output_token_ids == [5, 2]
    assert pool.num_free == 8


# -- n > 1 siblings ------------------------------------------------------------------------------


def test_siblings_wait_for_the_first_prompt_then_share_its_blocks() -> None:
    s, pool = make(budget=4)
    prompt = list(range(10))
    first = req("x#0", prompt, t=0)
    sib = req("x#1", prompt, t=0, wait_for=first)
    s.add(first)
    s.add(sib)
    out, _ = step(s)
    assert plan(out) == [("x#0", 0, 4, False)]
    out, _ = step(s)
    assert plan(out) == [("x#0", 4, 4, False)]
    out, _ = step(s)
    # budget is left, but the sibling waits until the first has its whole prompt computed
    assert plan(out) == [("x#0", 8, 2, True)]
    assert sib.status is RequestStatus.WAITING
    out, _ = step(s)
    assert plan(out) == [("x#0", 10, 1, True), ("x#1", 8, 2, True)]
    assert sib.num_cached_tokens == 8
    assert first.block_ids == [0, 1, 2]
    assert sib.block_ids == [0, 1, 3]
    assert ref_counts(pool)[:4] == [2, 2, 1, 1]


def test_sibling_of_an_aborted_first_starts_on_its_own() -> None:
    s, _ = make(budget=4)
    first = req("x#0", list(range(10)), t=0)
    sib = req("x#1", list(range(10)), t=0, wait_for=first)
    s.add(first)
    s.add(sib)
    step(s)
    s.finish("x#0", FinishReason.ABORT)
    out, _ = step(s)
    assert plan(out) == [("x#1", 4, 4, False)]  # the one block the first completed is reused
    assert sib.num_cached_tokens == 4
