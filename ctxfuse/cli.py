"""`ctxfuse` command line. Each subcommand's options are its component's configuration, with
defaults that serve a first-time user; `ctxfuse SUBCOMMAND --help` lists them all."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from cloud.engine.config import (
    CONTEXT_OVERFLOWS,
    CPU_KV_CACHE_GIB,
    DTYPES,
    KV_DTYPES,
    EngineConfig,
    SparseConfig,
)
from cloud.model.linear import WEIGHT_QUANTS


def add_engine_options(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M-Instruct, fetched if missing)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients use (default: smollm2-135m-instruct or the file's stem)",
    )
    g.add_argument(
        "--dtype",
        choices=["auto", *sorted(DTYPES)],
        default=d.dtype,
        help="activations, KV cache and dense weights (default auto: float32)",
    )
    g.add_argument(
        "--weight-quant",
        choices=WEIGHT_QUANTS,
        default=d.weight_quant,
        help=(
            "weight format: none (dense in --dtype), int8, int4, or auto (default): the fastest kernels on "
            "this CPU among those whose greedy output agrees with float32, timed at start"
        ),
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size in tokens (default 16; 32 for a quantized KV cache: key scales are per block)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        help=f"KV cache budget in GiB (default {CPU_KV_CACHE_GIB} on CPU, 90%% of free memory on a GPU)",
    )
    g.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default=d.kv_dtype,
        help="KV cache storage: auto (the run dtype), or int8 / int4 group-wise quantized (keys per channel "
        "within a block, values per token, fp16 scales and zero points)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt plus output (default: the model's context, scaled by RoPE scaling, capped by "
        "the KV budget)",
    )
    g.add_argument(
        "--rope-scaling",
        type=_json_object,
        default=None,
        help='RoPE scaling overriding the model\'s, as JSON, e.g. \'{"type": "yarn", "factor": 4}\' '
        "(types: linear, dynamic, yarn, llama3)",
    )
    g.add_argument(
        "--context-overflow",
        choices=CONTEXT_OVERFLOWS,
        default=d.context_overflow,
        help="a prompt longer than the context: error (default, context_length_exceeded); truncate_middle "
        "(drop the middle of the prompt, reported in usage.prompt_tokens_details.truncated_tokens)",
    )
    s = d.sparse
    g.add_argument(
        "--attention",
        choices=["dense", "sparse"],
        default=d.attention,
        help="dense (exact) or sparse: attention sinks + a recent window + the top KV blocks by key bounds "
        "(Quest), within --sparse-budget tokens",
    )
    g.add_argument(
        "--sparse-sinks", type=int, default=s.sinks, help=f"first tokens always attended ({s.sinks})"
    )
    g.add_argument(
        "--sparse-window", type=int, default=s.window, help=f"recent tokens always attended ({s.window})"
    )
    g.add_argument(
        "--sparse-budget", type=int, default=s.budget, help=f"tokens attended per query ({s.budget})"
    )
    g.add_argument(
        "--sparse-dense-layers",
        type=int,
        default=s.dense_layers,
        help=f"first layers that stay dense ({s.dense_layers})",
    )
    g.add_argument(
        "--sparse-top-p",
        type=float,
        default=None,
        help="keep the fewest selected blocks whose estimated attention mass reaches p (default off)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help=f"requests running at once (default {d.max_num_seqs})",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help=f"tokens per step; bounds prefill chunks (default {d.max_num_batched_tokens})",
    )
    g.add_argument(
        "--long-prefill-tokens",
        type=_non_negative,
        default=d.long_prefill_tokens,
        help="while other requests wait or run, a prompt computes at most this many tokens per step, "
        "so short prompts start and others decode alongside a long one "
        f"(default {d.long_prefill_tokens}; 0: no cap)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=d.max_waiting,
        help=f"waiting requests before new ones are refused (default {d.max_waiting})",
    )
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        weight_quant=args.weight_quant,
        block_size=args.block_size,
        kv_cache_memory_gib=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_tokens=args.long_prefill_tokens,
        max_waiting=args.max_queue,
        enable_prefix_caching=not args.no_prefix_caching,
        attention=args.attention,
        sparse=SparseConfig(
            args.sparse_sinks,
            args.sparse_window,
            args.sparse_budget,
            args.sparse_dense_layers,
            args.sparse_top_p,
        ),
        kv_dtype=args.kv_dtype,
        rope_scaling=args.rope_scaling,
        context_overflow=args.context_overflow,
    )


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from exc
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _json_object(text: str) -> dict[str, float | str]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _cmd_models_fetch(args: argparse.Namespace) -> int:
    from cloud.model.registry import fetch
    from edge.vision.model_files import ensure

    print(fetch(quiet=args.quiet))
    print(ensure(quiet=args.quiet).root)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from cloud.engine.core import EngineCore
    from cloud.engine.request import SamplingParams

    core = EngineCore(engine_config(args))
    ids = core.encode_chat([{"role": "user", "content": args.prompt}])
    core.add_request("cli", ids, SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    while core.has_work():
        for o in core.step():
            print(o.text, end="", flush=True)
    print()
    return 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    from cloud.bench.engine_bench import BenchOptions, run

    result = run(engine_config(args), BenchOptions(quick=args.quick, reference=not args.no_reference))
    print(json.dumps(result, indent=2))
    return 0


def _cmd_bench_agreement(args: argparse.Namespace) -> int:
    from cloud.bench.agreement import run

    print(json.dumps(run(engine_config(args), max_tokens=args.max_tokens), indent=2))
    return 0


def _cmd_bench_gateway(args: argparse.Namespace) -> int:
    from gateway.bench.run import GatewayBenchOptions, run

    options = GatewayBenchOptions(
        duration_s=args.duration,
        connections=args.connections,
        steps=tuple(sorted(set(args.steps))),
        p99_budget_ms=args.p99_budget_ms,
    )
    print(json.dumps(run(options), indent=2))
    return 0


def _connection_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("connection counts must be >= 1")
    return counts


def add_bench_gateway_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from gateway.bench.run import GatewayBenchOptions

    d = GatewayBenchOptions()
    bg = bench.add_parser(
        "gateway",
        help="latency the gateway adds (instant fake engine vs a raw ASGI app, driven by wrk); prints JSON",
    )
    bg.add_argument(
        "--duration", type=float, default=d.duration_s, help=f"seconds per wrk run (default {d.duration_s:g})"
    )
    bg.add_argument(
        "--connections",
        type=int,
        default=d.connections,
        help=f"connections for the added-latency comparison (default {d.connections})",
    )
    bg.add_argument(
        "--steps",
        type=_connection_counts,
        default=list(d.steps),
        help="connection counts stepped through to find the highest rate within the p99 budget "
        f"(default {','.join(map(str, d.steps))})",
    )
    bg.add_argument(
        "--p99-budget-ms",
        type=float,
        default=d.p99_budget_ms,
        help=f"p99 latency budget for the rate search, ms (default {d.p99_budget_ms:g})",
    )
    bg.set_defaults(func=_cmd_bench_gateway)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ctxfuse", description="Long-context LLM serving with an edge-cloud split."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="manage model files").add_subparsers(
        dest="models_command", required=True
    )
    f = models.add_parser(
        "fetch",
        help="fetch the default model and build the image encoder's files in the cache"
        " (CTXFUSE_HOME or ~/.cache/ctxfuse)",
    )
    f.add_argument("--quiet", action="store_true")
    f.set_defaults(func=_cmd_models_fetch)

    g = sub.add_parser("generate", help="answer one chat prompt with the engine (a quick check)")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    add_engine_options(g)
    g.set_defaults(func=_cmd_generate)

    from ctxfuse.serve_cli import add_serve_parser

    add_serve_parser(sub)
    from ctxfuse.edge_cli import add_edge_parser
    from ctxfuse.worker_cli import add_worker_parser

    add_worker_parser(sub)
    add_edge_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    be = bench.add_parser(
        "engine", help="engine prefill, decode, TTFT and memory, beside transformers; prints JSON"
    )
    be.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    be.add_argument("--no-reference", action="store_true", help="skip the transformers side")
    add_engine_options(be)
    be.set_defaults(func=_cmd_bench_engine)
    ba = bench.add_parser(
        "agreement", help="greedy agreement of the chosen weight path with the float32 reference"
    )
    ba.add_argument("--max-tokens", type=int, default=64)
    add_engine_options(ba)
    ba.set_defaults(func=_cmd_bench_agreement)
    add_bench_gateway_parser(bench)
    from gateway.bench.fleet_bench import add_fleet_bench_parser

    add_fleet_bench_parser(bench)
    from cloud.bench.longctx import add_longctx_parser

    add_longctx_parser(bench)
    from cloud.bench.prefill_cap import add_prefill_cap_parser

    add_prefill_cap_parser(bench)
    from cloud.bench.structured_bench import add_structured_parser

    add_structured_parser(bench)
    from edge.bench.cli import add_edge_bench_parser

    add_edge_bench_parser(bench)
    from ctxfuse.certs_cli import add_certs_parser

    add_certs_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from shared.errors import CtxfuseError

        if isinstance(exc, CtxfuseError):
            print(f"ctxfuse: {exc.message}", file=sys.stderr)
            return 2
        raise
