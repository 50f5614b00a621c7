"""`ctxfuse bench structured`: the command line and the printed table; the measuring is in
structured_run.py, the figures in structured_results.py."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path

from cloud.engine.config import DTYPES, EngineConfig
from cloud.model.formats import WEIGHT_QUANTS

from .report import publish
from .structured_results import FULL, QUICK, Report
from .structured_run import run


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
    config = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, weight_quant=args.weight_quant
    )
    report = run(config, sizes)
    publish(args.out, _rounded(asdict(report)), _table(report))
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
        "--device",
        default=d.device,
        help="auto (default: a CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N",
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
        "--dtype",
        choices=["auto", *sorted(DTYPES)],
        default=d.dtype,
        help="default %(default)s: bfloat16 on a GPU, float32 on a CPU",
    )
    g.add_argument(
        "--weight-quant",
        choices=WEIGHT_QUANTS,
        default=d.weight_quant,
        help="weight format, as for `ctxfuse serve` (default %(default)s: the fastest kernels, timed at "
        "start)",
    )
    p.set_defaults(func=cmd_structured)
