"""Random submit / step / abort sequences against a small pool (so preemption happens), checking the
block bookkeeping after every action, and that every request finishes when steps run to the end."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.request import FinishReason, Request, RequestStatus
from cloud.engine.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from shared.block_hash import hash_block
from shared.engine_types import SamplingParams
from shared.errors import QueueFullError

BS = 4
NUM_BLOCKS = 8
CAPACITY = NUM_BLOCKS * BS  # like the engine core, no request may outgrow the pool
EOS = 0
SHARED = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # a common prompt head, to get prefix hits
CONFIG = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=6, max_waiting=6, max_model_len=CAPACITY)
MAX_DRAIN_STEPS = 2000


def expected_hashes(req: Request, num_blocks: int) -> list[bytes]:
    out: list[bytes] = []
    for i in range(num_blocks):
        out.append(hash_block(out[-1] if out else None, req.token_ids[i * BS : (i + 1) * BS], req.extra_key))
    return out


class SchedulerMachine(RuleBasedStateMachine):
    config = CONFIG

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.s = Scheduler(self.config, self.pool, BS)
        self.submitted: list[Request] = []
        self.aborted: set[str] = set()
        self.clock = 0.0

    def _live(self) -> list[Request]:
        return list(self.s.requests.values())

    def _submit(self, req: Request) -> None:
        full = len(self.s.waiting) >= self.config.max_waiting
        try:
            self.s.add(req)
        except QueueFullError:
            assert full
            return
        assert not full
        self.submitted.append(req)

    def _step(self, data: st.DataObject, abort_mid_step: bool = False) -> None:
        before = {r.request_id: (r.num_computed_tokens, r.num_tokens) for r in self._live()}
        out = self.s.schedule()
        self._check_output(out, before)
        if abort_mid_step and out.chunks:
            victim = data.draw(st.sampled_from([c.request.request_id for c in out.chunks]))
            self._abort(victim)
        sampled = {
            c.request.request_id: [data.draw(st.integers(EOS, 5), label=c.request.request_id)]
            for c in out.chunks
            if c.sample
        }
        events = self.s.update(out, sampled)
        assert {e.request.request_id for e in events} == {
            c.request.request_id for c in out.chunks if c.sample and c.request.request_id not in self.aborted
        }
        for e in events:
            assert e.request.output_token_ids[-1] == e.token_id
            assert (e.finish is not None) == e.request.is_finished
        for c in out.chunks:
            if c.request.status is RequestStatus.RUNNING:
                assert c.request.num_computed_tokens == c.start_pos + len(c.token_ids)

    def _check_output(self, out: SchedulerOutput, before: dict[str, tuple[int, int]]) -> None:
        ids = [c.request.request_id for c in out.chunks]
        assert len(ids) == len(set(ids))
        assert not set(ids) & set(out.preempted)
        assert 0 < out.num_tokens <= self.config.max_num_batched_tokens or not self.s.requests
        assert len(self.s.running) <= self.config.max_num_seqs
        for c in out.chunks:
            req = c.request
            end = c.start_pos + len(c.token_ids)
            assert req.status is RequestStatus.RUNNING
            assert len(c.token_ids) >= 1
            assert c.start_pos == req.num_computed_tokens
            # a request starts or resumes from its cached prefix only (whole blocks)
            if before[req.request_id][0] != c.start_pos:
                assert c.start_pos % BS == 0
            assert c.token_ids == req.token_ids[c.start_pos : end]
            assert c.block_ids == req.block_ids
            assert len(c.block_ids) * BS >= end
            assert c.sample == (end == req.num_tokens)
        for rid in out.preempted:
            req = self.s.requests[rid]
            assert req.status is RequestStatus.WAITING
            assert req.num_computed_tokens == 0

    def _abort(self, rid: str) -> None:
        req = self.s.finish(rid, FinishReason.ABORT)
        assert req is not None
        self.aborted.add(rid)
        assert req.block_ids == []
        assert req.finish_reason is FinishReason.ABORT

    # -- actions ---------------------------------------------------------------------------------

    @rule(
        prompt_len=st.integers(1, 20),
        shared=st.integers(0, len(SHARED)),
        tail=st.lists(st.integers(1, 3), min_size=20, max_size=20),
        max_tokens=st.integers(1, 10),
        priority=st.integers(0, 2),
    )
    def submit(self, prompt_len: int, shared: int, tail: list[int], max_tokens: int, priority: int) -> None:
        head = SHARED[: min(shared, prompt_len)]
        prompt = head + tail[: prompt_len - len(head)]
        max_tokens = min(max_tokens, CAPACITY - prompt_len)  # what the engine core lets through
        self.clock += 1
        params = SamplingParams(max_tokens=max_tokens)
        rid = f"r{len(self.submitted)}-{self.clock}"
        self._submit(Request(rid, prompt, params, frozenset({EOS}), priority, arrival_time=self.clock))

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data(), max_tokens=st.integers(1, 6))
    def submit_sibling(self, data: st.DataObject, max_tokens: int) -> None:
        first = data.draw(st.sampled_from(sorted(self._live(), key=lambda r: r.request_id)))
        prompt = first.prompt_token_ids
        params = SamplingParams(max_tokens=min(max_tokens, CAPACITY - len(prompt)))
        self.clock += 1
        rid = f"r{len(self.submitted)}-{self.clock}"
        sib = Request(
            rid,
            list(prompt),
            params,
            frozenset({EOS}),
            first.priority,
            arrival_time=self.clock,
            wait_for=first,
        )
        self._submit(sib)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self._step(data)

    @rule(data=st.data(), n=st.integers(2, 5))
    def steps(self, data: st.DataObject, n: int) -> None:
        for _ in range(n):
            self._step(data)

    @precondition(lambda self: bool(self.s.running))
    @rule(data=st.data())
    def step_with_abort_while_it_runs(self, data: st.DataObject) -> None:
        self._step(data, abort_mid_step=True)

    @precondition(lambda self: bool(self.s.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self._abort(data.draw(st.sampled_from(sorted(self.s.requests))))

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def ref_counts_equal_holders(self) -> None:
        holders = Counter(b for r in self._live() for b in r.block_ids)
        assert [b.ref_count for b in self.pool.blocks] == [holders[i] for i in range(NUM_BLOCKS)]

    @invariant()
    def free_queue_holds_exactly_unreferenced_blocks(self) -> None:
        free = list(self.pool._free)  # the queue itself: no public view of its members
        assert len(free) == len(set(free)) == self.pool.num_free
        assert set(free) == {b.block_id for b in self.pool.blocks if b.ref_count == 0}

    @invariant()
    def requests_hold_consistent_blocks(self) -> None:
        for r in self._live():
            assert len(set(r.block_ids)) == len(r.block_ids)
            # the simulated model samples after every finished prefill, so one token is always pending
            assert r.num_computed_tokens < r.num_tokens
            if r.status is RequestStatus.RUNNING:
                assert len(r.block_ids) * BS >= r.num_computed_tokens
                full = r.num_computed_tokens // BS
                # every fully computed block carries its prefix hash (so other requests may share it)
                hashes = expected_hashes(r, full)
                assert [self.pool.blocks[b].block_hash for b in r.block_ids[:full]] == hashes
            else:
                assert r.status is RequestStatus.WAITING
                assert r.block_ids == []
                assert r.num_computed_tokens == 0

    @invariant()
    def queues_partition_live_requests(self) -> None:
        running = [r.request_id for r in self.s.running]
        waiting = [r.request_id for r in self.s.waiting]
        assert sorted(running + waiting) == sorted(self.s.requests)
        assert all(r.status is RequestStatus.RUNNING for r in self.s.running)
        keys = [(r.priority, r.arrival_time) for r in self.s.waiting]
        assert keys == sorted(keys)
        assert len(running) <= self.config.max_num_seqs

    @invariant()
    def cache_points_at_blocks_with_that_hash(self) -> None:
        for h, bid in self.pool.cached.items():
            assert self.pool.blocks[bid].block_hash == h

    @invariant()
    def finished_requests_hold_nothing(self) -> None:
        for r in self.submitted:
            if r.is_finished:
                assert r.request_id not in self.s.requests
                assert r.block_ids == []
                assert len(r.output_token_ids) <= r.params.max_tokens
        if not self.s.requests:
            assert self.pool.num_free == NUM_BLOCKS

    def teardown(self) -> None:
        """Run steps to the end: everything submitted finishes, for its own reason, and frees its blocks."""
        for _ in range(MAX_DRAIN_STEPS):
            if not self.s.requests:
                break
            out = self.s.schedule()
            self.s.update(out, {c.request.request_id: [1] for c in out.chunks if c.sample})
            self.ref_counts_equal_holders()
            self.requests_hold_consistent_blocks()
        assert not self.s.requests, f"livelock: {sorted(self.s.requests)} never finished"
        assert self.pool.num_free == NUM_BLOCKS
        assert sorted(self.pool._free) == list(range(NUM_BLOCKS))
        for r in self.submitted:
            assert r.is_finished
            if r.request_id in self.aborted:
                assert r.finish_reason is FinishReason.ABORT
            elif r.output_token_ids[-1] == EOS:
                assert r.finish_reason is FinishReason.STOP
            else:
                assert r.finish_reason is FinishReason.LENGTH
                assert len(r.output_token_ids) == r.params.max_tokens or r.num_tokens == CAPACITY


def machine_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


SchedulerMachine.TestCase.settings = machine_settings(150)
TestSchedulerProperties = SchedulerMachine.TestCase


class CappedPrefillMachine(SchedulerMachine):
    """The same with long prefills capped at 2 tokens a step while others wait or run."""

    config = replace(CONFIG, long_prefill_tokens=2)


CappedPrefillMachine.TestCase.settings = machine_settings(100)
TestCappedPrefillProperties = CappedPrefillMachine.TestCase
