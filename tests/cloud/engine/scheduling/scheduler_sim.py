"""A scheduler simulator for tests: tiny configs (block_size 4, a handful of blocks), and helpers
that run `schedule()` then `update(out, sampled)` with the test playing the model by choosing each
sampled token."""

from __future__ import annotations

from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.request import FinishReason, Request
from cloud.engine.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, TokenEvent
from shared.engine_types import SamplingParams

BS = 4
TOKEN = 99  # what the simulated model samples unless a test says otherwise


def make(
    num_blocks: int = 8,
    budget: int = 16,
    max_num_seqs: int = 32,
    max_waiting: int = 256,
    max_model_len: int = 8192,
    long_prefill: int = 0,
) -> tuple[Scheduler, BlockPool]:
    pool = BlockPool(num_blocks)
    config = SchedulerConfig(
        max_num_seqs, budget, max_waiting, max_model_len, long_prefill_tokens=long_prefill
    )
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
    sampled = {
        c.request.request_id: [tokens.get(c.request.request_id, TOKEN)] for c in out.chunks if c.sample
    }
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
