"""`ctxfuse bench serve`: its options and the command (usage: gateway/bench/serving/__init__.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gateway.bench.serving.options import (
    BUILT_IN_DATASETS,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_SWEEP,
    ServeBenchOptions,
    normalise_base_url,
)


def concurrency_list(text: str) -> tuple[int, ...]:
    """`1,8,32` -> (1, 8, 32)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrency values must be integers >= 1: {text!r}")
    return values


def options_from(args: argparse.Namespace) -> ServeBenchOptions:
    concurrency: tuple[int | None, ...] = args.concurrency or DEFAULT_SWEEP
    if args.concurrency is None and args.request_rate is not None:
        concurrency = (None,)  # a request rate alone sets the load: no cap
    return ServeBenchOptions(
        base_urls=tuple(normalise_base_url(u) for u in args.base_url),
        model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY") or None,
        endpoint=args.endpoint,
        dataset=args.dataset,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_prompts=args.num_prompts,
        concurrency=concurrency,
        request_rate=args.request_rate,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        seed=args.seed,
        warmup=args.warmup,
        out=args.out,
    )


def cmd_serve_bench(args: argparse.Namespace) -> int:
    """0 when the bench ran (some requests may have failed: the table says so), 1 when no request
    completed at all, 2 when it could not start (bad options, no server, no dataset)."""
    from gateway.bench.serving.report import notes, table, write
    from gateway.bench.serving.runner import run
    from shared.errors import CtxfuseError

    try:
        options = options_from(args)
        result = run(options)
    except (ValueError, CtxfuseError) as exc:
        print(f"ctxfuse: {exc}", file=sys.stderr)
        return 2
    write(result, options.out)
    print(table(result.runs))
    for line in notes(result.runs):
        print(f"- {line}")
    print(f"\nJSON in {options.out}")
    return 0 if any(f.completed for f in result.runs) else 1


def add_serve_bench_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = ServeBenchOptions(base_urls=("-",))
    p = bench.add_parser(
        "serve",
        help="TTFT, ITL, TPOT, E2E and throughput of any OpenAI-compatible server under streamed load "
        "(as `vllm bench serve`)",
        description="Streams chat (or completion) requests at one or more OpenAI-compatible servers and "
        "reports TTFT, ITL, TPOT and E2E (mean, p50, p90, p99) and throughputs per concurrency value. "
        "Lengths are in words, a stand-in for tokens (no tokenizer is needed); the servers' usage "
        "chunks give the true token counts.",
    )
    p.add_argument(
        "--base-url",
        action="append",
        required=True,
        help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine); repeat it to compare "
        "servers in one bench, each with the same prompts",
    )
    p.add_argument("--model", default=None, help="model name to send (default: each server's first listed)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY when set)")
    p.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default=d.endpoint,
        help="/v1/chat/completions or /v1/completions (default %(default)s)",
    )
    p.add_argument(
        "--dataset",
        default=d.dataset,
        help=f"{' or '.join(BUILT_IN_DATASETS)} or a ShareGPT-like JSON/JSONL file: random words; one "
        "shared document of --input-len words and a short question per request (exercises prefix "
        "caching); or each conversation's first human turn (default %(default)s)",
    )
    p.add_argument(
        "--input-len",
        type=int,
        default=d.input_len,
        help="prompt length in words of about one token each (random, long-doc; default %(default)s)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help=f"max_tokens per request (default {DEFAULT_OUTPUT_LEN}; for a file: the length in words of "
        "each conversation's first answer)",
    )
    p.add_argument(
        "--range-ratio",
        type=float,
        default=d.range_ratio,
        help="random lengths drawn from [len*(1-r), len*(1+r)] (random dataset; default %(default)s)",
    )
    p.add_argument("--num-prompts", type=int, default=d.num_prompts, help="requests per run (default 32)")
    p.add_argument(
        "--concurrency",
        type=concurrency_list,
        default=None,
        help="requests in flight, a comma-separated list with one run per value (default "
        f"{','.join(map(str, DEFAULT_SWEEP))}; with --request-rate: the cap, none by default)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals per second (default: every request at once, the concurrency the limit)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send `ignore_eos: true` (a vLLM and llama.cpp extension) so every answer runs to max_tokens",
    )
    p.add_argument("--temperature", type=float, default=d.temperature, help="default %(default)s")
    p.add_argument("--seed", type=int, default=d.seed, help="prompts and arrival times (default %(default)s)")
    p.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help="unmeasured requests per server before its runs (default %(default)s)",
    )
    p.add_argument("--out", type=Path, default=d.out, help="JSON results file (default %(default)s)")
    p.set_defaults(func=cmd_serve_bench)
