"""`ctxfuse bench fleet`: TTFT and throughput of `random`, `least-load` and `prefix` routing across
the same `ctxfuse worker` processes, on a workload of users that each ask short questions about a
long document of their own (gateway/bench/fleet_workload.py).

The workers start once for the whole run. Each policy then gets a phase of its own
(gateway/bench/fleet_phase.py): a fresh fleet gateway in this process and fresh documents, so no
policy finds the prefixes another left cached. The phases run in the order of POLICIES rotated by the
seed. Results: a markdown table on stdout, JSON in `--out`.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from cloud.engine.config import LONG_PREFILL_TOKENS
from cloud.model.registry import fetch
from cloud.model.text_side import load_text_side
from gateway.backends.fleet.config import Policy
from gateway.bench.fleet_workload import workload
from gateway.bench.worker_proc import WorkerProcess

if TYPE_CHECKING:
    from gateway.bench.fleet_phase import PhaseResult

POLICIES: tuple[Policy, ...] = ("random", "least-load", "prefix")
SERVED_NAME = "fleet-bench"
AIM = 5.0  # the aim: prefix-affinity TTFT p90 at least 5x better than random


@dataclass(frozen=True, slots=True)
class FleetBenchOptions:
    workers: int = 2
    users: int = 4
    questions: int = 12
    prefix_tokens: int = 1500
    concurrency: int = 1  # one request in flight: no hit waits behind a miss (docs/benchmarks.md)
    max_tokens: int = 8
    seed: int = 0
    kv_cache_gib: float = 1.0  # per worker: every phase's documents fit, so nothing is evicted
    dtype: str = "float32"
    weight_quant: str = "none"  # dense float32 prefills faster on a small CPU than auto's choice
    long_prefill_tokens: int = LONG_PREFILL_TOKENS  # workers' --long-prefill-tokens (0: no cap)
    model: Path | None = None
    out: Path = Path("bench-results/fleet.json")

    def __post_init__(self) -> None:
        if self.workers < 2:
            raise ValueError("a fleet bench needs at least 2 workers")
        if min(self.users, self.questions, self.concurrency, self.max_tokens) < 1 or self.prefix_tokens < 16:
            raise ValueError("users, questions, concurrency and max tokens must be >= 1, prefix tokens >= 16")

    def engine_args(self) -> list[str]:
        max_model_len = self.prefix_tokens + 256 + self.max_tokens  # the document, template, question, answer
        return [
            *("--dtype", self.dtype, "--weight-quant", self.weight_quant),
            *("--kv-cache-memory", f"{self.kv_cache_gib:g}", "--max-model-len", str(max_model_len)),
            *("--long-prefill-tokens", str(self.long_prefill_tokens)),
        ]


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _start_workers(
    model: Path, options: FleetBenchOptions, key: str
) -> tuple[list[WorkerProcess], list[str]]:
    """The workers, all with `key` (the router's --backend-key)."""
    workers: list[WorkerProcess] = []
    try:
        args = options.engine_args()
        workers = [WorkerProcess(model, SERVED_NAME, *args, api_key=key) for _ in range(options.workers)]
        urls = [w.wait_ready() for w in workers]
        for url in urls:  # the first request of a process pays one-time costs: not any phase's
            body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            httpx.post(
                f"{url}/v1/chat/completions", json=body, timeout=120, trust_env=False, headers=_auth(key)
            ).raise_for_status()
    except BaseException:
        for w in workers:
            w.kill()
        raise
    return workers, urls


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _kv_usage(urls: list[str], key: str) -> list[float]:
    states = [httpx.get(f"{u}/internal/v1/state", trust_env=False, headers=_auth(key)).json() for u in urls]
    return [float(s["load"]["kv_usage"]) for s in states]


@dataclass(frozen=True, slots=True)
class PhaseFigures:
    policy: Policy
    requests: int
    failed: int
    errors: list[str]  # the first few distinct ones
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_max_ms: float
    misses: int  # requests that found less than half their prompt cached
    throughput_rps: float  # successful requests over the phase's wall clock
    wall_s: float
    cached_share: float  # prompt tokens served from the prefix cache, over all prompt tokens
    decisions: dict[str, int]  # the gateway's routing decisions
    kv_usage_after: list[float]  # each worker's KV usage once the phase is done


def summarise(phase: PhaseResult, kv_usage_after: list[float]) -> PhaseFigures:
    ok = [s for s in phase.samples if s.ok]
    ttft_ms = sorted(s.ttft_s * 1e3 for s in ok) or [0.0]
    # linear interpolation between order statistics (numpy's default); quantiles needs two points
    pct = statistics.quantiles(ttft_ms * 2 if len(ttft_ms) == 1 else ttft_ms, n=100, method="inclusive")
    prompt = sum(s.prompt_tokens for s in ok)
    return PhaseFigures(
        policy=phase.policy,
        requests=len(phase.samples),
        failed=len(phase.samples) - len(ok),
        errors=sorted({s.error for s in phase.samples if not s.ok})[:5],
        ttft_p50_ms=round(pct[49], 1),
        ttft_p90_ms=round(pct[89], 1),
        ttft_max_ms=round(ttft_ms[-1], 1),
        misses=sum(1 for s in ok if s.cached_tokens < s.prompt_tokens / 2),
        throughput_rps=round(len(ok) / phase.wall_s, 3),
        wall_s=round(phase.wall_s, 2),
        cached_share=round(sum(s.cached_tokens for s in ok) / prompt, 4) if prompt else 0.0,
        decisions=phase.decisions,
        kv_usage_after=kv_usage_after,
    )


def table(rows: list[PhaseFigures]) -> str:
    lines = [
        "| policy | TTFT p50 / p90 (ms) | throughput (req/s) | cached share | misses | decisions |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        shown = ", ".join(f"{k} {v}" for k, v in sorted(r.decisions.items()))
        lines.append(
            f"| {r.policy} | {r.ttft_p50_ms:,.0f} / {r.ttft_p90_ms:,.0f} | {r.throughput_rps:.2f} "
            f"| {r.cached_share:.1%} | {r.misses} / {r.requests} | {shown} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class FleetBenchResult:
    options: FleetBenchOptions
    model: str
    order: list[Policy]  # the order the phases ran in
    phases: list[PhaseFigures]  # in POLICIES' order
    random_over_prefix_p90: float
    least_load_over_prefix_p90: float

    @property
    def aim_met(self) -> bool:
        return self.random_over_prefix_p90 >= AIM

    def summary(self) -> str:
        return (
            f"random p90 / prefix p90 = {self.random_over_prefix_p90:.2f}x, least-load p90 / prefix p90 = "
            f"{self.least_load_over_prefix_p90:.2f}x (aim: random / prefix >= {AIM:g}x, "
            f"{'met' if self.aim_met else 'not met'})"
        )

    def to_json(self) -> str:
        data = asdict(self)
        data["options"] = {k: str(v) if isinstance(v, Path) else v for k, v in data["options"].items()}
        data |= {"aim_met": self.aim_met, "summary": self.summary(), "table": table(self.phases)}
        return json.dumps(data, indent=2) + "\n"


def run(options: FleetBenchOptions) -> FleetBenchResult:
    from gateway.bench.fleet_phase import (  # the gateway's server stack: not for `--help`
        PhaseSetup,
        run_phase,
    )

    model = options.model or fetch()
    tokenizer, _ = load_text_side(model)
    order = [POLICIES[(i + options.seed) % len(POLICIES)] for i in range(len(POLICIES))]
    say(f"{options.workers} workers ({' '.join(options.engine_args())}); phases: {', '.join(order)}")
    key = secrets.token_urlsafe(18)
    workers, urls = _start_workers(model, options, key)
    figures: dict[str, PhaseFigures] = {}
    try:
        o = options
        setup = PhaseSetup(urls, model, SERVED_NAME, o.concurrency, o.max_tokens, o.seed, worker_key=key)
        for phase, policy in enumerate(order):
            queries = workload(
                tokenizer, options.users, options.questions, options.prefix_tokens, options.seed, phase
            )
            figures[policy] = summarise(run_phase(policy, queries, setup), _kv_usage(urls, key))
            say(f"{policy}: {figures[policy]}")
    finally:
        for w in workers:
            w.stop()
    p90 = {k: max(f.ttft_p90_ms, 1e-9) for k, f in figures.items()}
    result = FleetBenchResult(
        options=options,
        model=str(model),
        order=order,
        phases=[figures[p] for p in POLICIES],
        random_over_prefix_p90=round(p90["random"] / p90["prefix"], 2),
        least_load_over_prefix_p90=round(p90["least-load"] / p90["prefix"], 2),
    )
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(result.to_json())
    return result


def cmd_fleet(args: argparse.Namespace) -> int:
    names = [f for f in FleetBenchOptions.__dataclass_fields__ if hasattr(args, f)]
    try:
        options = FleetBenchOptions(**{n: getattr(args, n) for n in names})
    except ValueError as exc:
        print(f"ctxfuse: {exc}", file=sys.stderr)
        return 2
    from gateway.ops.logs import configure_logging

    configure_logging("warning")  # the in-process gateways' request lines would bury the bench's own
    result = run(options)
    print(table(result.phases))
    print()
    print(f"{result.summary()}; JSON in {options.out}")
    return 0


def add_fleet_bench_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = FleetBenchOptions()
    p = bench.add_parser(
        "fleet",
        help="TTFT p50/p90 and throughput of random, least-load and prefix routing across ctxfuse workers",
    )
    p.add_argument("--workers", type=int, default=d.workers, help="worker processes (default %(default)s)")
    p.add_argument(
        "--users", type=int, default=d.users, help="users, one document each (default %(default)s)"
    )
    p.add_argument(
        "--questions", type=int, default=d.questions, help="questions per user (default %(default)s)"
    )
    p.add_argument(
        "--prefix-tokens",
        type=int,
        default=d.prefix_tokens,
        help="tokens of each user's document, by the model's tokenizer (default %(default)s)",
    )
    p.add_argument(
        "--concurrency", type=int, default=d.concurrency, help="requests in flight (default %(default)s)"
    )
    p.add_argument(
        "--max-tokens", type=int, default=d.max_tokens, help="tokens per answer (default %(default)s)"
    )
    p.add_argument("--seed", type=int, default=d.seed, help="documents, order, phase rotation (default 0)")
    p.add_argument(
        "--kv-cache-memory",
        dest="kv_cache_gib",
        type=float,
        default=d.kv_cache_gib,
        help="each worker's KV budget in GiB; must hold every phase's documents (default %(default)s)",
    )
    p.add_argument("--dtype", default=d.dtype, help="workers' --dtype (default %(default)s)")
    p.add_argument(
        "--weight-quant", default=d.weight_quant, help="workers' --weight-quant (default %(default)s)"
    )
    p.add_argument(
        "--long-prefill-tokens",
        type=int,
        default=d.long_prefill_tokens,
        help="workers' --long-prefill-tokens (default %(default)s; 0: no cap)",
    )
    p.add_argument("--model", type=Path, default=None, help="a .gguf file or a Hugging Face directory")
    p.add_argument("--out", type=Path, default=d.out, help="JSON results file (default %(default)s)")
    p.set_defaults(func=cmd_fleet)
