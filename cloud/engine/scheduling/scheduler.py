"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget. Running requests go first (a decode costs one token, an unfinished
prefill takes what the budget leaves); then waiting requests are admitted in priority, then arrival,
order, starting from their cached prefix. With `long_prefill_tokens`, a prefill longer than that
takes at most that many tokens of a step whenever another request is running or waiting (vLLM's
`long_prefill_token_threshold`): the budget it leaves lets a short prompt start, and a running
request decode, in the same step rather than after the long prompt's last chunk; alone, a long
prompt still takes the whole budget. When the pool runs out of blocks, the running request
that would be served last is preempted: its blocks are freed and its progress counter drops to 0,
so it later recomputes (mostly from the prefix cache). The scheduler never touches tensors: it
returns which requests compute which tokens into which blocks.

With a prune budget (kv/prune_plan.py), a request whose prompt is longer than the budget computes
its prompt (its last chunk stops at the prompt's end) and, on the next step it is scheduled, trades
the prompt's blocks for fresh ones holding the kept tokens: the scheduler allocates them and
releases the prompt's (cached, they stay in the prefix cache), and tells the runner to copy (a
PruneOrder). Such a request is admitted only while the pool holds its peak, prompt and kept blocks.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.kv.layout import PageLayout
from cloud.engine.kv.manager import KVManager
from cloud.engine.kv.prune_plan import OBSERVATION_WINDOW, PruneOrder, num_dropped_blocks, num_kept, prunes
from cloud.engine.request import FinishReason, Request, RequestStatus
from cloud.engine.speculative import drafts as drafting
from cloud.engine.speculative.drafts import SpecConfig
from shared.engine_types import SamplingParams
from shared.errors import QueueFullError

if TYPE_CHECKING:
    from cloud.grammar.compiled import CompiledGrammar


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 32  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens computed per step (the chunked-prefill chunk bound)
    max_waiting: int = 256  # bounded waiting queue; beyond it submissions get QueueFullError
    max_model_len: int = 8192
    # sliding_window requests keep sink_blocks + a ring: at most ring_blocks live blocks between steps
    sink_blocks: int = 0
    ring_blocks: int = 0
    # when another request could use the step, a prefill computes at most this many tokens of it
    # (0: no cap), so one long prompt cannot hold a step's whole budget while short ones wait
    long_prefill_tokens: int = 0
    # a prompt longer than this keeps this many tokens' KV at most once computed (None: no pruning)
    prune_budget: int | None = None
    speculative: SpecConfig | None = None  # drafts (None: one token per step)


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """What the runner learns of a request when it is admitted (again, after a preemption): the
    runner keeps it in its input batch and never reads the mutable Request."""

    token_ids: tuple[int, ...]  # every known token: the prompt, and the outputs after a preemption
    num_prompt_tokens: int
    params: SamplingParams
    grammar: CompiledGrammar | None
    sliding: bool  # a sliding-window request: its dropped blocks leave -1 in block_ids


@dataclass(slots=True)
class ScheduledChunk:
    request: Request  # the scheduler's own (update() advances it); the runner never reads it
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0]
    block_ids: list[int]  # all of the request's blocks, in position order
    sample: bool  # the chunk reaches the last known token: sample the next one
    new: NewRequestData | None = None  # set on the step that admits the request
    # speculative decoding: token_ids ends with this many drafted tokens, sampled from (verified) too
    num_drafts: int = 0
    request_id: str = ""

    def __post_init__(self) -> None:
        self.request_id = self.request.request_id


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # ended since the last step (the runner drops them)
    prunes: list[PruneOrder] = field(default_factory=list)  # carried out before the step's forward

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(slots=True)
class TokenEvent:
    """A request sampled `token_ids` this step (more than one: drafts it accepted); `finish` tells if
    the last ended it."""

    request: Request
    token_ids: list[int]
    finish: FinishReason | None

    @property
    def token_id(self) -> int:
        return self.token_ids[-1]


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, pool: BlockPool, block_size: int, layout: PageLayout | None = None
    ) -> None:
        self.config = config
        self.pool = pool
        self.kv = KVManager(pool, block_size, layout)
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.prefix_queried_tokens = 0  # prompt tokens looked up in the prefix cache at first admission
        self.prefix_hit_tokens = 0  # of which were found there
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # speculative decoding: tokens drafted since start...
        self.num_accepted_tokens = 0  # ...and accepted
        self._finished: list[str] = []  # ids ended since the last schedule()

    @staticmethod
    def _order(req: Request) -> tuple[int, float]:
        return (req.priority, req.arrival_time)

    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        self.requests[req.request_id] = req
        bisect.insort(self.waiting, req, key=self._order)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """End a request (abort, stop string, error): free its blocks at once. None if unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self._finished.append(request_id)
        return req

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.pruned = False  # it recomputes its prompt in full, then prunes again
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=self._order)

    def _chunk(
        self, req: Request, num_new: int, admitted: bool = False, drafts: list[int] | None = None
    ) -> ScheduledChunk:
        start = req.num_computed_tokens
        end = start + num_new
        new = None
        if admitted:
            new = NewRequestData(
                tuple(req.token_ids), req.num_prompt_tokens, req.params, req.grammar, req.sliding
            )
        drafts = drafts or []
        return ScheduledChunk(
            req,
            req.token_ids[start:end] + drafts,
            start,
            list(req.block_ids),
            end == req.num_tokens,
            new,
            len(drafts),
        )

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Tokens drafted for a decoding request this step ([] when it should not speculate)."""
        spec = self.config.speculative
        if spec is None or not drafting.wants_drafts(req, spec):
            return []
        start = req.num_computed_tokens
        if (
            req.num_tokens - start != 1
            or len(self.running) > spec.max_running
            or req.sliding
            or prunes(req.num_prompt_tokens, self.config.prune_budget)
            or drafting.resting(req)
        ):
            return []
        tokens_left = req.params.max_tokens - len(req.output_token_ids)
        context_left = self.config.max_model_len - req.num_tokens
        k = drafting.draft_count(spec.num_tokens, budget, tokens_left, context_left)
        if spec.within_block:
            k = min(k, self.kv.block_size - 2 - start % self.kv.block_size)
        return drafting.propose(req, spec, k) if k > 0 else []

    def _prefill_cap(self) -> int:
        """The most tokens one prefill chunk may take this step."""
        cap = self.config.long_prefill_tokens
        shared = len(self.running) + len(self.waiting) > 1  # someone else could use the budget
        return cap if cap > 0 and shared else self.config.max_num_batched_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished=self._finished)
        self._finished = []
        budget = self.config.max_num_batched_tokens
        cap = self._prefill_cap()
        scheduled: set[int] = set()
        for req in sorted(self.running, key=self._order):  # higher priority gets blocks first
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            start = req.num_computed_tokens
            num_new = self._until_prune(req, start, min(req.num_tokens - start, budget, cap))
            drafts = self._drafts(req, budget)
            num_new += len(drafts)
            while not (self._prune(req, out) and self.kv.allocate(req, num_new)):
                if drafts:  # drafts never cost another request its place
                    num_new, drafts = num_new - len(drafts), []
                    continue
                # the lowest-priority request not yet handed out this step (req itself qualifies)
                victim = max((r for r in self.running if id(r) not in scheduled), key=self._order)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                out.prunes = [p for p in out.prunes if p.request_id != victim.request_id]
                if victim is req:
                    break
            else:
                out.chunks.append(self._chunk(req, num_new - len(drafts), drafts=drafts))
                scheduled.add(id(req))
                budget -= num_new
        if not out.preempted:
            self._admit(out, budget, cap)
        return out

    def _admit(self, out: SchedulerOutput, budget: int, cap: int) -> None:
        for req in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            sib = req.wait_for
            if sib is not None and not sib.is_finished and sib.num_computed_tokens < sib.num_prompt_tokens:
                continue  # its sibling's prompt blocks will be in the cache soon: share them
            cached = self.kv.cached_prefix(req)
            if prunes(req.num_prompt_tokens, self.config.prune_budget):
                # the observation window's queries are computed, never taken from the cache
                cached = cached[: (req.num_prompt_tokens - OBSERVATION_WINDOW) // self.kv.block_size]
            num_cached = len(cached) * self.kv.block_size
            num_new = self._until_prune(req, num_cached, min(req.num_tokens - num_cached, budget, cap))
            if not self._peak_fits(req, cached) or not self.kv.allocate(req, num_new, cached):
                return  # no room now; later requests wait too, so the head is not starved
            self.waiting.remove(req)
            req.num_computed_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                self.prefix_queried_tokens += req.num_prompt_tokens
                self.prefix_hit_tokens += num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(self._chunk(req, num_new, admitted=True))
            budget -= num_new

    def _until_prune(self, req: Request, start: int, num_new: int) -> int:
        """num_new tokens from `start`, cut so that a prompt to be pruned ends a chunk (its outputs,
        after a preemption, are computed over the pruned cache, as they were the first time)."""
        end = req.num_prompt_tokens
        if req.pruned or start >= end or not prunes(end, self.config.prune_budget):
            return num_new
        return min(num_new, end - start)

    def _peak_fits(self, req: Request, cached: list[int]) -> bool:
        """Whether the pool now holds what a request to be pruned takes at its peak (the rest of its
        prompt's blocks and the kept tokens' at once); True for any other request."""
        budget, p = self.config.prune_budget, req.num_prompt_tokens
        if budget is None or not prunes(p, budget):
            return True
        bs = self.kv.block_size
        revived = sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)
        need = -(-p // bs) - len(cached) + revived + -(-num_kept(p, budget, bs) // bs)
        return need <= self.pool.num_free

    def _prune(self, req: Request, out: SchedulerOutput) -> bool:
        """Prune the request's prompt if it is due (computed in full, not pruned yet): fresh blocks
        for the kept tokens, the prompt's released. False, changing nothing, when the pool cannot
        give the fresh blocks."""
        budget, p = self.config.prune_budget, req.num_prompt_tokens
        if budget is None or not prunes(p, budget) or req.pruned or req.num_computed_tokens < p:
            return True
        bs = self.kv.block_size
        dropped, kept = num_dropped_blocks(p, budget, bs), num_kept(p, budget, bs)
        fresh = self.pool.allocate(-(-kept // bs))
        if fresh is None:
            return False
        old = [b for b in req.block_ids if b >= 0]  # the prompt's: it has computed nothing more
        # the runner copies from `old` before this step's forward writes anything: they may go to
        # another request in this very step
        self.pool.free(old)
        req.block_ids = [-1] * dropped + fresh
        req.pruned = True
        out.prunes.append(PruneOrder(req.request_id, old, fresh, p, kept))
        return True

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[TokenEvent]:
        """Advance progress counters after the runner computed `out`; record sampled tokens (a chunk
        with drafts: the drafts the model accepted, then its own next token)."""
        events = []
        for chunk in out.chunks:
            req = chunk.request
            if req.status is not RequestStatus.RUNNING:  # aborted while the step ran
                continue
            tokens = sampled.get(req.request_id, [])
            finish = None
            appended: list[int] = []
            for token in tokens:  # up to the one that ends the request
                appended.append(token)
                finish = req.append_token(token)
                if finish is None and req.num_tokens >= self.config.max_model_len and not req.sliding:
                    finish = FinishReason.LENGTH
                if finish is not None:
                    break
            if chunk.num_drafts:
                accepted = len(tokens) - 1
                drafting.record(req, chunk.num_drafts, accepted)
                self.num_draft_tokens += chunk.num_drafts
                self.num_accepted_tokens += accepted
                # the KV of the last known token and the accepted drafts: all but the newest token
                req.num_computed_tokens = req.num_tokens - 1
            else:
                req.num_computed_tokens = chunk.start_pos + len(chunk.token_ids)
            if not req.pruned:  # a pruned request's blocks do not hold its tokens' hash chain
                self.kv.register_full_blocks(req)
            if req.sliding:
                self.kv.slide(req, self.config.sink_blocks, self.config.ring_blocks)
            self.kv.slide_windows(req)
            if not appended:
                continue
            events.append(TokenEvent(req, appended, finish))
            if finish is not None:
                self.finish(req.request_id, finish)
        return events
