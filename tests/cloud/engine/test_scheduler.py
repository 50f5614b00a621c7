"""The scheduler driven directly on tiny configs (block_size 4, a handful of blocks): `schedule()`
then `update(out, sampled)`, with the test playing the model by choosing each sampled token.
Asserts exact block ids, chunk plans, prefix hits, preemption and finishing."""

from __future__ import annotations

import pytest

from cloud.engine.block_pool import BlockPool, hash_block
from cloud.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from cloud.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, TokenEvent
from shared.errors import QueueFullError

BS = 4
TOKEN = 99  # what the simulated model samples unless a test says otherwise


def make(
    num_blocks: int = 8,
    budget: int = 16,
    max_num_seqs: int = 32,
    max_waiting: int = 256,
    max_model_len: int = 8192,
) -> tuple[Scheduler, BlockPool]:
    pool = BlockPool(num_blocks)
    config = SchedulerConfig(max_num_seqs, budget, max_waiting, max_model_len)
    return Scheduler(config, pool, BS), pool


def req(
    rid: str,
    prompt: list[int],
    max_tokens: int = 16,
    priority: int = 0,
    t: float = 0.0,
    eos: frozenset[int] = frozenset(),
    wait_for: Request | None = None,
) -> Request:
    return Request(
        rid, prompt, SamplingParams(max_tokens=max_tokens), eos, priority, arrival_time=t, wait_for=wait_for
    )


def step(s: Scheduler, tokens: dict[str, int] | None = None) -> tuple[SchedulerOutput, list[TokenEvent]]:
    """One engine step: sample a token for every chunk that reached its request's end."""
    out = s.schedule()
    tokens = tokens or {}
    sampled = {c.request.request_id: tokens.get(c.request.request_id, TOKEN) for c in out.chunks if c.sample}
    return out, s.update(out, sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, start position, tokens computed, sample) per chunk."""
    return [(c.request.request_id, c.start_pos, len(c.token_ids), c.sample) for c in out.chunks]


def events(evs: list[TokenEvent]) -> list[tuple[str, int, FinishReason | None]]:
    return [(e.request.request_id, e.token_id, e.finish) for e in evs]


def ref_counts(pool: BlockPool) -> list[int]:
    return [b.ref_count for b in pool.blocks]


def run_to_end(s: Scheduler, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not s.num_unfinished:
            return
        step(s)
    raise AssertionError("requests did not finish")


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
    evs = s.update(out, {"a": 1, "b": 2})
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
