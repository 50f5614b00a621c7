"""`ctxfuse bench prefill-cap`: what `--long-prefill-tokens` does to short requests that arrive while a
long prompt is being prefilled, measured in-process on the engine core, without and with the cap,
side by side in one run.

Each round: one long prompt (cold, its own random tokens) is submitted and computes one step; then
`--shorts` short prompts arrive together. Steps run until all are done. Per configuration and
round: the short prompts' time to first token (from their arrival), the long prompt's time to first
token (from its own submission), and the wall time of the round. Rounds alternate the configurations
(A B B A ...), so a slow spell of the machine falls on both.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from cloud.bench.report import say
from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.model.loading import LoadedModel, load_model
from shared.engine_types import SamplingParams


@dataclass(frozen=True, slots=True)
class CapOptions:
    long_tokens: int = 6000
    shorts: int = 4
    short_tokens: int = 48
    max_tokens: int = 8  # tokens each request generates
    cap: int = 256
    budget: int = 2048  # --max-num-batched-tokens
    rounds: int = 4
    seed: int = 0
    out: Path = Path("bench-results/prefill-cap.json")
    device: str = "auto"


@dataclass(slots=True)
class Round:
    cap: int
    short_ttft_s: list[float]
    long_ttft_s: float
    wall_s: float
    steps: int


def _round(core: EngineCore, opts: CapOptions, rng: random.Random, tag: str) -> Round:
    vocab = core.tokenizer.vocab_size
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=0.0, ignore_eos=True)
    long_ids = [rng.randrange(100, vocab) for _ in range(opts.long_tokens)]
    t0 = time.perf_counter()
    core.add_request(f"{tag}-long", long_ids, params)
    firsts: dict[str, float] = {}
    steps = 0

    def step() -> None:
        nonlocal steps
        steps += 1
        for o in core.step():
            if o.error is not None:
                raise RuntimeError(f"request {o.request_id} failed: {o.error}")
            if o.token_ids and o.request_id not in firsts:
                firsts[o.request_id] = time.perf_counter()

    step()  # the long prompt is under way
    arrived = time.perf_counter()
    for i in range(opts.shorts):
        ids = [rng.randrange(100, vocab) for _ in range(opts.short_tokens)]
        core.add_request(f"{tag}-short{i}", ids, params)
    while core.has_work():
        step()
    shorts = [firsts[f"{tag}-short{i}"] - arrived for i in range(opts.shorts)]
    cap = core.scheduler.config.long_prefill_tokens
    return Round(cap, shorts, firsts[f"{tag}-long"] - t0, time.perf_counter() - t0, steps)


def _summary(rounds: list[Round]) -> dict[str, float]:
    shorts = sorted(t for r in rounds for t in r.short_ttft_s)
    return {
        "short_ttft_mean_ms": 1000 * statistics.fmean(shorts),
        "short_ttft_max_ms": 1000 * shorts[-1],
        "long_ttft_mean_ms": 1000 * statistics.fmean(r.long_ttft_s for r in rounds),
        "round_wall_mean_s": statistics.fmean(r.wall_s for r in rounds),
        "steps_mean": statistics.fmean(r.steps for r in rounds),
    }


def run(opts: CapOptions, loaded: LoadedModel | None = None) -> dict[str, object]:
    loaded = loaded or load_model(None)
    base = EngineConfig(
        device=opts.device,
        dtype="float32",
        weight_quant="none",
        kv_cache_memory_gib=0.5,
        max_model_len=opts.long_tokens + opts.max_tokens + 16,
        max_num_batched_tokens=opts.budget,
        enable_prefix_caching=False,  # every round computes its prompts in full
    )
    cores = {c: EngineCore(replace(base, long_prefill_tokens=c), loaded) for c in (0, opts.cap)}
    rng = random.Random(opts.seed)
    _round(cores[0], replace(opts, long_tokens=64), rng, "warm")  # one-time costs: no round's
    rounds: dict[int, list[Round]] = {0: [], opts.cap: []}
    for i in range(opts.rounds):
        order = (0, opts.cap) if i % 2 == 0 else (opts.cap, 0)
        for cap in order:
            r = _round(cores[cap], opts, rng, f"r{i}c{cap}")
            rounds[cap].append(r)
            mean = 1000 * statistics.fmean(r.short_ttft_s)
            say(f"round {i} cap {cap}: shorts' TTFT mean {mean:.0f} ms, long's {1000 * r.long_ttft_s:.0f} ms")
    off, on = _summary(rounds[0]), _summary(rounds[opts.cap])
    result: dict[str, object] = {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "torch_threads": torch.get_num_threads(),
        "no_cap": off,
        "cap": on,
        "short_ttft_no_cap_over_cap": off["short_ttft_mean_ms"] / on["short_ttft_mean_ms"],
        "long_ttft_cap_over_no_cap": on["long_ttft_mean_ms"] / off["long_ttft_mean_ms"],
        "round_wall_cap_over_no_cap": on["round_wall_mean_s"] / off["round_wall_mean_s"],
        "rounds": {str(c): [asdict(r) for r in rs] for c, rs in rounds.items()},
    }
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(result, indent=2))
    return result


def table(result: dict[str, object]) -> str:
    off, on = result["no_cap"], result["cap"]
    assert isinstance(off, dict) and isinstance(on, dict)
    cap = result["options"]["cap"]  # type: ignore[index]
    rows = [
        "| | short TTFT mean / max (ms) | long TTFT (ms) | round wall (s) | steps |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, f in (("no cap", off), (f"cap {cap}", on)):
        rows.append(
            f"| {name} | {f['short_ttft_mean_ms']:,.0f} / {f['short_ttft_max_ms']:,.0f} | "
            f"{f['long_ttft_mean_ms']:,.0f} | {f['round_wall_mean_s']:.2f} | {f['steps_mean']:.1f} |"
        )
    return "\n".join(rows)


def cmd_prefill_cap(args: argparse.Namespace) -> int:
    opts = CapOptions(**{f: getattr(args, f) for f in CapOptions.__dataclass_fields__})
    if min(opts.long_tokens, opts.shorts, opts.short_tokens, opts.max_tokens, opts.cap, opts.rounds) < 1:
        print("ctxfuse: every count must be at least 1", file=sys.stderr)
        return 2
    result = run(opts)
    print(table(result))
    print()
    print(
        f"shorts' TTFT without / with the cap = {result['short_ttft_no_cap_over_cap']:.2f}x; "
        f"the long prompt's TTFT with / without = {result['long_ttft_cap_over_no_cap']:.2f}x; "
        f"round wall with / without = {result['round_wall_cap_over_no_cap']:.2f}x; JSON in {opts.out}"
    )
    return 0


def add_prefill_cap_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = CapOptions()
    p = bench.add_parser(
        "prefill-cap",
        help="short requests' TTFT behind a long prefill, without and with --long-prefill-tokens",
    )
    p.add_argument(
        "--long-tokens", type=int, default=d.long_tokens, help="the long prompt (default %(default)s)"
    )
    p.add_argument(
        "--shorts", type=int, default=d.shorts, help="short prompts arriving (default %(default)s)"
    )
    p.add_argument("--short-tokens", type=int, default=d.short_tokens, help="each (default %(default)s)")
    p.add_argument(
        "--max-tokens", type=int, default=d.max_tokens, help="generated each (default %(default)s)"
    )
    p.add_argument(
        "--cap", type=int, default=d.cap, help="--long-prefill-tokens compared (default %(default)s)"
    )
    p.add_argument(
        "--budget", type=int, default=d.budget, help="--max-num-batched-tokens (default %(default)s)"
    )
    p.add_argument("--rounds", type=int, default=d.rounds, help="per configuration (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="prompt tokens (default %(default)s)")
    p.add_argument("--out", type=Path, default=d.out, help="JSON results file (default %(default)s)")
    p.add_argument(
        "--device",
        default=d.device,
        help="auto (default: a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N",
    )
    p.set_defaults(func=cmd_prefill_cap)
