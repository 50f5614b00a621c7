"""`ctxfuse bench structured`: what schema-constrained decoding costs, measured in one run: grammar
compile time per schema (cold, and a cached lookup), the time of the grammar mask per decode step,
and decode tokens/s with and without a grammar at each concurrency, side by side.

The engine is driven through its synchronous step loop (no threads), so wall times are exact. Both
decode sides see the same prompts and generate exactly the same number of tokens per request: the
constrained schema's shortest valid output is far longer than a run, so both end by length (checked).
Only decode steps are timed (every request already has its first token), and the two sides alternate
within each repeat, so machine noise hits both alike; figures are medians over repeats.
"""

from __future__ import annotations

import importlib.metadata
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from cloud.engine.config import EngineConfig
from shared.engine_types import SamplingParams
from shared.grammar_spec import GrammarSpec

from .structured_schemas import DECODE_SCHEMA, SCHEMAS

if TYPE_CHECKING:  # the engine (and xgrammar) load only when the benchmark runs, not for --help
    from cloud.engine.core import EngineCore
    from cloud.engine.sampling.grammar_mask import Constrained, GrammarMasks
    from cloud.model.loading import LoadedModel

from .report import say
from .structured_results import (
    GOAL_RATIO,
    CompileFigures,
    DecodeFigures,
    DecodeRun,
    EngineInfo,
    Machine,
    Report,
    Sizes,
    spread,
)

PROMPT = "Inventory of warehouse {i}: list every item as a JSON array of records with id, name, status, qty."


class _MaskTimer:
    """Times each GrammarMasks.apply (and accept) of one sampler while on. Installed on the
    instance, for the benchmark only: the engine's code stays as it is."""

    def __init__(self, masks: GrammarMasks) -> None:
        self._apply, self._accept = masks.apply, masks.accept
        # instance wrappers, on purpose: the sampler calls these two attributes each step
        masks.apply = self._timed_apply  # type: ignore[method-assign]
        masks.accept = self._timed_accept  # type: ignore[method-assign]
        self.on = False
        self.calls: list[tuple[float, int]] = []
        self.accepts: list[float] = []

    def _timed_apply(
        self, logits: torch.Tensor, requests: Sequence[Constrained]
    ) -> tuple[torch.Tensor, list[int]]:
        t = time.perf_counter()
        masked, rows = self._apply(logits, requests)
        if self.on and rows:
            self.calls.append((time.perf_counter() - t, len(rows)))
        return masked, rows

    def _timed_accept(self, req: Constrained, token_id: int) -> bool:
        t = time.perf_counter()
        ok = self._accept(req, token_id)
        if self.on:
            self.accepts.append(time.perf_counter() - t)
        return ok


def _compile_figures(core: EngineCore, sizes: Sizes) -> CompileFigures:
    compiler = core.grammars
    names = list(SCHEMAS)[: sizes.schemas]

    def spec(name: str, rnd: int) -> GrammarSpec:
        # a description unique to the round changes the spec's key, not the grammar: each round
        # misses our cache and compiles in full (xgrammar's own cache is off)
        return GrammarSpec.json_schema({"description": f"bench round {rnd}", **SCHEMAS[name]})

    compiler.compile(GrammarSpec.json_schema({"description": "warm-up", "type": "object"}))
    hits, misses = compiler.hits, compiler.misses
    cold: dict[str, list[float]] = {n: [] for n in names}
    for rnd in range(sizes.compile_repeats):
        for n in names:
            t = time.perf_counter()
            compiler.compile(spec(n, rnd))
            cold[n].append(time.perf_counter() - t)
    misses = compiler.misses - misses
    held = [spec(n, sizes.compile_repeats - 1) for n in names]  # the latest round: still cached
    cached = []
    for _ in range(sizes.cached_lookups):
        for s in held:
            t = time.perf_counter()
            compiler.compile(s)
            cached.append(time.perf_counter() - t)
    medians = sorted(((statistics.median(v) * 1e3, n) for n, v in cold.items()), reverse=True)
    return CompileFigures(
        spread([x for v in cold.values() for x in v], 1e3),
        spread(cached, 1e6),
        {n: round(ms, 2) for ms, n in medians[:3]},
        misses,
        compiler.hits - hits,
    )


def _decode_run(
    core: EngineCore, timer: _MaskTimer, prompts: list[list[int]], params: SamplingParams, tag: str
) -> DecodeRun:
    for i, ids in enumerate(prompts):
        core.add_request(f"{tag}-{i}", ids, params)
    got = {f"{tag}-{i}": 0 for i in range(len(prompts))}
    reasons: dict[str, str] = {}

    def take() -> int:
        outs = core.step()
        for o in outs:
            if o.error is not None:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            got[o.request_id] += len(o.token_ids)
            reasons[o.request_id] = o.finish_reason or ""
        return sum(len(o.token_ids) for o in outs)

    while core.has_work() and min(got.values()) == 0:  # prefill: not timed
        take()
    timer.on, timer.calls, timer.accepts = True, [], []
    steps, counted = [], 0
    start = time.perf_counter()
    while core.has_work():
        t = time.perf_counter()
        counted += take()
        steps.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    timer.on = False
    by_length = all(n == params.max_tokens and reasons[r] == "length" for r, n in got.items())
    return DecodeRun(counted / elapsed if elapsed else 0.0, steps, timer.calls, timer.accepts, by_length)


def _decode_figures(c: int, free: list[DecodeRun], bound: list[DecodeRun]) -> DecodeFigures:
    u = statistics.median(r.tok_s for r in free)
    k = statistics.median(r.tok_s for r in bound)
    calls = [x for r in bound for x in r.mask_calls]
    mask_us = spread([s for s, _ in calls], 1e6)
    free_ms = spread([s for r in free for s in r.step_s], 1e3)
    bound_ms = spread([s for r in bound for s in r.step_s], 1e3)
    return DecodeFigures(
        c,
        u,
        k,
        k / u if u else 0.0,
        free_ms.p50 / bound_ms.p50 if bound_ms.p50 else 0.0,
        [r.tok_s for r in free],
        [r.tok_s for r in bound],
        free_ms,
        bound_ms,
        mask_us,
        spread([s / n for s, n in calls], 1e6),
        mask_us.p50 / (bound_ms.p50 * 1e3) if bound_ms.p50 else 0.0,
        spread([s for r in bound for s in r.accept_s], 1e6),
        all(r.by_length for r in free),
        all(r.by_length for r in bound),
    )


def _decode(core: EngineCore, sizes: Sizes) -> list[DecodeFigures]:
    timer = _MaskTimer(core.sampler.grammars)
    grammar = GrammarSpec.json_schema(DECODE_SCHEMA)
    prompts = [
        core.encode_chat([{"role": "user", "content": PROMPT.format(i=i)}])
        for i in range(max(sizes.concurrency))
    ]
    free = SamplingParams(max_tokens=sizes.tokens, temperature=0.0, ignore_eos=True)
    bound = SamplingParams(max_tokens=sizes.tokens, temperature=0.0, grammar=grammar)
    for side, p in (("free", free), ("bound", bound)):  # warm-up: kernels, matchers, the grammar
        _decode_run(core, timer, prompts, replace(p, max_tokens=min(8, sizes.tokens)), f"warm-{side}")
    runs: dict[tuple[int, bool], list[DecodeRun]] = {}
    for rnd in range(sizes.repeats):
        for c in sizes.concurrency:
            # ABBA order: whichever side runs second (warmer caches, a prefix-cache hit) alternates
            for constrained in (False, True) if rnd % 2 == 0 else (True, False):
                tag = f"r{rnd}-c{c}-{'bound' if constrained else 'free'}"
                r = _decode_run(core, timer, prompts[:c], bound if constrained else free, tag)
                runs.setdefault((c, constrained), []).append(r)
                say(f"{tag}: {r.tok_s:.1f} tok/s")
    return [_decode_figures(c, runs[c, False], runs[c, True]) for c in sizes.concurrency]


def _engine_info(config: EngineConfig, core: EngineCore) -> EngineInfo:
    return EngineInfo(
        "server defaults" if config == EngineConfig(model=config.model) else "custom",
        core.model_name,
        f"{config.dtype} -> {config.run_dtype}",
        config.weight_quant,
        core.weight_plan.describe(),
        core.max_model_len,
    )


def _machine() -> Machine:
    return Machine(
        os.cpu_count() or 0,
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0,
        torch.get_num_threads(),
        torch.__version__,
        importlib.metadata.version("xgrammar"),
    )


def run(config: EngineConfig, sizes: Sizes, loaded: LoadedModel | None = None) -> Report:
    from cloud.engine.core import EngineCore

    core = EngineCore(config, loaded)
    engine = _engine_info(config, core)
    say(f"engine: {engine}; {torch.get_num_threads()} torch threads")
    comp = _compile_figures(core, sizes)
    say(f"cold compile p50 {comp.cold_ms.p50:.1f} ms, p99 {comp.cold_ms.p99:.1f} ms")
    decode = _decode(core, sizes)
    # the aim is at concurrency 8; a smaller run is judged at its largest concurrency
    top = next((d for d in decode if d.concurrency == 8), decode[-1])
    verdict = "met" if top.ratio >= GOAL_RATIO else "NOT met"
    goal = f"constrained/unconstrained >= {GOAL_RATIO} at concurrency {top.concurrency}: "
    goal += f"{top.ratio:.3f}, {verdict} (by median step time: {top.step_ratio:.3f})"
    warnings = [
        f"concurrency {d.concurrency}: not every request ended by length with {sizes.tokens} tokens, "
        "so the two sides did not generate alike"
        for d in decode
        if not (d.constrained_ended_by_length and d.unconstrained_ended_by_length)
    ]
    for d in decode:
        runs = d.unconstrained_runs + d.constrained_runs
        if len(runs) > 2 and max(runs) > 1.2 * min(runs):
            warnings.append(f"concurrency {d.concurrency}: tokens/s varied over 20% across runs (noise?)")
    return Report(_machine(), engine, sizes, comp, decode, goal, warnings)
