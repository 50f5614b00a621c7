"""The figures `ctxfuse bench structured` reports: sizes, spreads, compile and decode results."""

from __future__ import annotations

from dataclasses import dataclass

from .structured_schemas import SCHEMAS

GOAL_RATIO = 0.95  # constrained / unconstrained decode tokens/s the issue asks for at concurrency 8


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


def spread(xs: list[float], scale: float) -> Spread:
    """Linear-interpolated percentiles of xs, times scale (to ms or us)."""
    s = sorted(x * scale for x in xs) or [0.0]

    def pct(q: float) -> float:
        pos = q * (len(s) - 1)
        lo = int(pos)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)

    return Spread(len(xs), pct(0.5), pct(0.99), s[-1])
