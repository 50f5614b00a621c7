"""`ctxfuse bench kv-layout`: how many tokens fit in one KV budget when a model's sliding-window
layers keep only their window (cloud/engine/kv/layout.py) against every layer keeping every token
(`--disable-hybrid-kv-cache-manager`), measured on the engine core in one run.

The budget is what the plain layout needs for `--fit` requests of `--tokens` tokens. Both layouts
get it and the same `--requests` distinct prompts at once (greedy, a few tokens each); each step the
tokens held by running requests are summed: the most at once is what the budget held. Preemptions
(a request giving its blocks back to be recomputed) and the greedy tokens of every request, which
must equal between the layouts, are reported beside it. The planner's figure for longer requests
(how many fit while decoding, from the same page accounting the pool does) follows for --plan
lengths, which would take too long to run on a CPU.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cloud.bench.report import publish, say
from cloud.engine.config import DTYPES, DType, EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.kv.layout import blocks_for_context, resident_pages
from cloud.engine.kv.memory import plan_kv
from cloud.model.config import ModelConfig
from cloud.model.loading import LoadedModel, load_model
from shared.engine_types import SamplingParams


@dataclass(frozen=True, slots=True)
class LayoutBenchOptions:
    model: str = "gemma-3-270m"
    tokens: int = 4096  # prompt tokens per request
    requests: int = 8
    fit: int = 2  # requests the plain layout's budget holds at once
    max_tokens: int = 4
    chunk: int = 2048  # --max-num-batched-tokens
    plan_lengths: tuple[int, ...] = (8192, 32768)
    dtype: DType = "float32"
    seed: int = 0
    out: Path = Path("bench-results/kv-layout.json")


@dataclass(slots=True)
class LayoutRun:
    layout: str
    budget_gib: float
    blocks: int
    bytes_per_block: int
    most_tokens: int  # tokens held by running requests at once, at most
    most_running: int
    preemptions: int
    peak_kv_mib: float  # blocks in use at the peak


@dataclass(slots=True)
class Planned:
    tokens: int
    plain_requests: int
    hybrid_requests: int


def _config(opts: LayoutBenchOptions, gib: float, hybrid: bool) -> EngineConfig:
    return EngineConfig(
        dtype=opts.dtype,
        weight_quant="none",
        kv_cache_memory_gib=gib,
        max_model_len=opts.tokens + opts.max_tokens + 16,
        max_num_seqs=opts.requests,
        max_num_batched_tokens=opts.chunk,
        enable_prefix_caching=False,  # distinct prompts; a cached block would not count as held
        disable_hybrid_kv_cache_manager=not hybrid,
    )


def _budget(opts: LayoutBenchOptions, model: ModelConfig) -> float:
    """GiB that hold `fit` requests in the plain layout (whole blocks, one spare)."""
    probe = plan_kv(replace(_config(opts, 1.0, hybrid=False), max_model_len=None), model, model.max_position)
    per_block = probe.bytes_per_token * probe.block_size
    blocks = opts.fit * blocks_for_context(None, opts.tokens + opts.max_tokens, opts.chunk, probe.block_size)
    return (blocks + 1) * per_block / 2**30


def _run(opts: LayoutBenchOptions, loaded: LoadedModel, gib: float, hybrid: bool) -> tuple[LayoutRun, dict]:
    core = EngineCore(_config(opts, gib, hybrid), loaded)
    say(core.kv_plan.describe())
    rng = random.Random(opts.seed)
    vocab = core.tokenizer.vocab_size
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(opts.requests):
        core.add_request(f"r{i}", [rng.randrange(1000, vocab // 2) for _ in range(opts.tokens)], params)
    out: dict[str, list[int]] = {}
    most_tokens = most_running = 0
    core.pool.low_free = core.pool.num_free
    while core.has_work():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        running = core.scheduler.running
        most_running = max(most_running, len(running))
        most_tokens = max(most_tokens, sum(r.num_computed_tokens for r in running))
    block_bytes = int(core.kv_plan.bytes_per_token * core.kv_plan.block_size)
    run = LayoutRun(
        "per layer type" if hybrid else "every layer",
        round(gib, 4),
        core.pool.num_blocks,
        block_bytes,
        most_tokens,
        most_running,
        core.scheduler.num_preemptions,
        round((core.pool.num_blocks - core.pool.low_free) * block_bytes / 2**20, 1),
    )
    say(f"{run}")
    return run, out


def run(opts: LayoutBenchOptions) -> tuple[list[LayoutRun], list[Planned], bool]:
    loaded = load_model(opts.model)
    model = loaded.weights.config
    gib = _budget(opts, model)
    runs, outputs = [], []
    for hybrid in (True, False):
        r, out = _run(opts, loaded, gib, hybrid)
        runs.append(r)
        outputs.append(out)
    planned = []
    for n in opts.plan_lengths:
        cfg = replace(_config(opts, gib, True), max_model_len=None)
        sized = replace(cfg, kv_cache_memory_gib=_budget(replace(opts, tokens=n), model))
        h = plan_kv(sized, model, max(n, model.max_position))
        p = plan_kv(replace(sized, disable_hybrid_kv_cache_manager=True), model, max(n, model.max_position))
        bs = h.block_size
        planned.append(
            Planned(
                n,
                p.num_blocks // resident_pages(None, n, bs),
                h.num_blocks // resident_pages(h.layout, n, bs),
            )
        )
    return runs, planned, outputs[0] == outputs[1]


def report(runs: list[LayoutRun], planned: list[Planned], same: bool, opts: LayoutBenchOptions) -> str:
    base = runs[-1]
    lines = [
        f"{opts.model}, {opts.requests} requests of {opts.tokens} tokens at once, the KV budget of "
        f"{opts.fit} in the plain layout ({base.budget_gib:.3f} GiB, {opts.dtype})",
        "| layout | most tokens held at once | x | preemptions | peak KV (MiB) |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        x = r.most_tokens / base.most_tokens if base.most_tokens else float("nan")
        cells = (r.layout, r.most_tokens, f"{x:.2f}", r.preemptions, f"{r.peak_kv_mib:.0f}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines.append(f"greedy tokens of every request equal between the layouts: {same}")
    lines += [
        "",
        f"planned (the pool's page accounting), a budget holding {opts.fit} such requests in the plain "
        "layout:",
        "| request tokens | every layer: requests decoding at once | per layer type | x |",
        "|---|---|---|---|",
    ]
    for p in planned:
        x = p.hybrid_requests / p.plain_requests if p.plain_requests else float("nan")
        lines.append(f"| {p.tokens} | {p.plain_requests} | {p.hybrid_requests} | {x:.2f} |")
    return "\n".join(lines)


def cmd_kv_layout(args: argparse.Namespace) -> int:
    opts = LayoutBenchOptions(
        model=args.model,
        tokens=args.tokens,
        requests=args.requests,
        fit=args.fit,
        max_tokens=args.max_tokens,
        chunk=args.max_num_batched_tokens,
        dtype=args.dtype,
        seed=args.seed,
        out=args.out,
    )
    runs, planned, same = run(opts)
    payload = {
        "options": {k: str(v) for k, v in asdict(opts).items()},
        "runs": [asdict(r) for r in runs],
        "planned": [asdict(p) for p in planned],
        "same_tokens": same,
    }
    publish(opts.out, payload, report(runs, planned, same, opts))
    return 0 if same else 1


def add_kv_layout_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = LayoutBenchOptions()
    p = bench.add_parser(
        "kv-layout",
        help="tokens one KV budget holds when sliding-window layers keep only their window, against all",
    )
    p.add_argument("--model", default=d.model, help="a model with sliding-window layers (%(default)s)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="prompt tokens per request (%(default)s)")
    p.add_argument("--requests", type=int, default=d.requests, help="requests sent at once (%(default)s)")
    p.add_argument(
        "--fit", type=int, default=d.fit, help="requests the budget holds in the plain layout (%(default)s)"
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="greedy tokens each (%(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.chunk, help="%(default)s")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="run dtype (%(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=Path, default=d.out, help="JSON results (%(default)s)")
    p.set_defaults(func=cmd_kv_layout)
