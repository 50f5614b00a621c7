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

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cloud.engine.config import DTYPES, EngineConfig
from cloud.engine.request import SamplingParams
from cloud.grammar.spec import GrammarSpec
from cloud.model.linear import WEIGHT_QUANTS

from .structured_schemas import DECODE_SCHEMA, SCHEMAS

if TYPE_CHECKING:  # the engine (and xgrammar) load only when the benchmark runs, not for --help
    from cloud.engine.core import EngineCore
    from cloud.engine.grammar_mask import GrammarMasks
    from cloud.engine.request import Request
    from cloud.model.loading import LoadedModel

GOAL_RATIO = 0.95  # constrained / unconstrained decode tokens/s the issue asks for at concurrency 8
PROMPT = "Inventory of warehouse {i}: list every item as a JSON array of records with id, name, status, qty."


@dataclass(frozen=True, slots=True)
class Sizes:
    schemas: int  # the first this many of SCHEMAS
    compile_repeats: int  # cold compilations of each schema
    cached_lookups: int  # cached lookups of each schema
    tokens: int  # generated per decoding request (>= 2: the first comes with prefill and is not timed)
    repeats: int  # runs of each decode side per concurrency
    concurrency: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (1 <= self.schemas <= len(SCHEMAS)) or self.tokens < 2 or min(self.concurrency) < 1:
            raise ValueError(f"bad sizes: {self}")
        if min(self.compile_repeats, self.cached_lookups, self.repeats) < 1:
            raise ValueError(f"bad sizes: {self}")


FULL = Sizes(len(SCHEMAS), 5, 100, 128, 5, (1, 8))
QUICK = Sizes(len(SCHEMAS), 2, 20, 32, 2, (1, 8))


@dataclass(frozen=True, slots=True)
class Spread:
    n: int
    p50: float
    p99: float
    max: float


@dataclass(frozen=True, slots=True)
class CompileFigures:
    cold_ms: Spread  # one compilation, nothing cached
    cached_us: Spread  # GrammarCompiler.compile of a spec it already holds
    slowest_ms: dict[str, float]  # the slowest schemas, by their median cold compilation
    cache_misses: int  # all cold compilations missed the cache: equals their count
    cache_hits: int


@dataclass(frozen=True, slots=True)
class DecodeRun:
    tok_s: float  # tokens generated in the timed decode steps / their wall time
    step_s: list[float]
    mask_calls: list[tuple[float, int]]  # (seconds of one GrammarMasks.apply, constrained rows)
    accept_s: list[float]  # one GrammarMasks.accept each
    by_length: bool  # every request ended by length with exactly the asked tokens


@dataclass(frozen=True, slots=True)
class DecodeFigures:
    concurrency: int
    unconstrained_tok_s: float  # median over repeats
    constrained_tok_s: float
    ratio: float  # constrained / unconstrained
    # unconstrained / constrained median step time, pooled over repeats: the same comparison, robust
    # to bursts of load from other processes (a whole run's wall time is not)
    step_ratio: float
    unconstrained_runs: list[float]  # tokens/s of each repeat, in run order
    constrained_runs: list[float]
    unconstrained_step_ms: Spread
    constrained_step_ms: Spread
    mask_us_per_step: Spread  # one apply: the batch's bitmask filled and applied
    mask_us_per_token: Spread  # one apply / the constrained rows it served
    # median apply / median constrained step: medians, as a sum would let steps slowed by other
    # processes dilute the share
    mask_share_of_step: float
    accept_us_per_token: Spread  # advancing one request's matcher by its sampled token
    unconstrained_ended_by_length: bool
    constrained_ended_by_length: bool


@dataclass(frozen=True, slots=True)
class Machine:
    cpu_count: int
    cpus_usable: int  # this process's CPU affinity
    torch_threads: int
    torch: str
    xgrammar: str


@dataclass(frozen=True, slots=True)
class EngineInfo:
    config: str  # "server defaults" when the engine runs as `ctxfuse serve` would, else "custom"
    model: str
    dtype: str  # as configured -> as run
    weight_quant: str
    weights: str  # the kernels weight_quant chose
    max_model_len: int


@dataclass(frozen=True, slots=True)
class Report:
    machine: Machine
    engine: EngineInfo
    sizes: Sizes
    compile: CompileFigures
    decode: list[DecodeFigures]
    goal: str  # the aim and whether this run meets it
    warnings: list[str]


def _say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _spread(xs: list[float], scale: float) -> Spread:
    """Linear-interpolated percentiles of xs, times scale (to ms or us)."""
    s = sorted(x * scale for x in xs) or [0.0]

    def pct(q: float) -> float:
        pos = q * (len(s) - 1)
        lo = int(pos)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)

    return Spread(len(xs), pct(0.5), pct(0.99), s[-1])


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

    def _timed_apply(self, logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, list[int]]:
        t = time.perf_counter()
        masked, rows = self._apply(logits, requests)
        if self.on and rows:
            self.calls.append((time.perf_counter() - t, len(rows)))
        return masked, rows

    def _timed_accept(self, req: Request, token_id: int) -> bool:
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
        _spread([x for v in cold.values() for x in v], 1e3),
        _spread(cached, 1e6),
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
    mask_us = _spread([s for s, _ in calls], 1e6)
    free_ms = _spread([s for r in free for s in r.step_s], 1e3)
    bound_ms = _spread([s for r in bound for s in r.step_s], 1e3)
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
        _spread([s / n for s, n in calls], 1e6),
        mask_us.p50 / (bound_ms.p50 * 1e3) if bound_ms.p50 else 0.0,
        _spread([s for r in bound for s in r.accept_s], 1e6),
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
                _say(f"{tag}: {r.tok_s:.1f} tok/s")
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
    _say(f"engine: {engine}; {torch.get_num_threads()} torch threads")
    comp = _compile_figures(core, sizes)
    _say(f"cold compile p50 {comp.cold_ms.p50:.1f} ms, p99 {comp.cold_ms.p99:.1f} ms")
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


def _table(r: Report) -> str:
    s, c = r.sizes, r.compile
    lines = [
        f"## Grammar compilation: {s.schemas} schemas x {s.compile_repeats} cold compilations",
        "",
        "| measure | n | p50 | p99 | max |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, x in (("cold compile (ms)", c.cold_ms), ("cached lookup (us)", c.cached_us)):
        lines.append(f"| {name} | {x.n} | {x.p50:.2f} | {x.p99:.2f} | {x.max:.2f} |")
    slow = ", ".join(f"{n} {ms:.1f}" for n, ms in c.slowest_ms.items())
    lines += ["", f"slowest schemas (median ms): {slow}", ""]
    lines += [
        f"## Decode: {s.tokens} tokens per request, greedy, median of {s.repeats} repeats",
        "",
        "| concurrency | unconstrained tok/s | constrained tok/s | ratio | ratio by median step "
        "| mask us/step p50 | p99 | mask us/token p50 | p99 | mask share of step | accept us/token p50 "
        "| ended by length |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d in r.decode:
        ok = "yes" if d.constrained_ended_by_length and d.unconstrained_ended_by_length else "NO"
        lines.append(
            f"| {d.concurrency} | {d.unconstrained_tok_s:.1f} | {d.constrained_tok_s:.1f} | {d.ratio:.3f} "
            f"| {d.step_ratio:.3f} | {d.mask_us_per_step.p50:.0f} | {d.mask_us_per_step.p99:.0f} "
            f"| {d.mask_us_per_token.p50:.0f} | {d.mask_us_per_token.p99:.0f} | {d.mask_share_of_step:.1%} "
            f"| {d.accept_us_per_token.p50:.0f} | {ok} |"
        )
    e, m = r.engine, r.machine
    lines += [
        "",
        f"goal: {r.goal}",
        f"engine: {e.config}: {e.model}, dtype {e.dtype}, weight_quant {e.weight_quant} -> "
        f"weights {e.weights}",
        f"machine: {m.cpus_usable} usable CPUs of {m.cpu_count}, {m.torch_threads} torch threads, "
        f"torch {m.torch}, xgrammar {m.xgrammar}",
    ]
    return "\n".join(lines + [f"warning: {w}" for w in r.warnings])


def _rounded(x: object) -> object:
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_rounded(v) for v in x]
    return x


def cmd_structured(args: argparse.Namespace) -> int:
    sizes = QUICK if args.quick else FULL
    sizes = replace(sizes, tokens=args.tokens or sizes.tokens, repeats=args.repeats or sizes.repeats)
    config = EngineConfig(model=args.model, dtype=args.dtype, weight_quant=args.weight_quant)
    report = run(config, sizes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_rounded(asdict(report)), indent=2) + "\n")
    print(_table(report))
    print(f"\nresults: {args.out}")
    return 0


def add_structured_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = EngineConfig()
    p = bench.add_parser(
        "structured",
        help="schema-constrained decoding cost: grammar compile time, mask time per token, and decode "
        "tokens/s with and without a grammar; prints a markdown table, writes JSON",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run of a minute or two: {QUICK.tokens} tokens, {QUICK.repeats} repeats, "
        f"{QUICK.compile_repeats} compilations per schema (--tokens and --repeats still win)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=None,
        help=f"tokens generated per decoding request, at least 2 (default {FULL.tokens}; {QUICK.tokens} "
        "with --quick)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"runs of each decode side per concurrency, interleaved (default {FULL.repeats}; "
        f"{QUICK.repeats} with --quick)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results/structured.json"),
        help="JSON results file (default %(default)s)",
    )
    g = p.add_argument_group("engine (defaults: the server's)")
    g.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default SmolLM2)")
    g.add_argument(
        "--dtype", choices=["auto", *sorted(DTYPES)], default=d.dtype, help="default %(default)s: float32"
    )
    g.add_argument(
        "--weight-quant",
        choices=WEIGHT_QUANTS,
        default=d.weight_quant,
        help="weight format, as for `ctxfuse serve` (default %(default)s: the fastest kernels, timed at "
        "start)",
    )
    p.set_defaults(func=cmd_structured)
