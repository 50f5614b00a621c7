"""`ctxfuse` command line. Each subcommand's options are its component's configuration, with
defaults that serve a first-time user; `ctxfuse SUBCOMMAND --help` lists them all.

A command's parser is built only when that command runs, and its module imports its component: so
`ctxfuse edge` and `ctxfuse certs` on a device never import the cloud side (torch, transformers,
xgrammar), and the edge installs without it (`pip install 'ctxfuse[edge]'`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def _cmd_models_fetch(args: argparse.Namespace) -> int:
    from cloud.model.registry import fetch
    from edge.vision.model_files import ensure
    from kernels.cpu import gguf_matmul, norm_rope, paged_attention, sampling

    print(fetch(quiet=args.quiet))
    print(ensure(quiet=args.quiet).root)
    # the C++ CPU kernels build once per machine (a warning and the PyTorch path where they cannot)
    built = all([m.available() for m in (gguf_matmul, paged_attention, norm_rope, sampling)])
    print(f"C++ CPU kernels: {'built' if built else 'unavailable, the PyTorch path serves'}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from cloud.engine.core import EngineCore
    from ctxfuse.engine_cli import engine_config
    from shared.engine_types import SamplingParams

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
    from ctxfuse.engine_cli import engine_config

    result = run(engine_config(args), BenchOptions(quick=args.quick, reference=not args.no_reference))
    print(json.dumps(result, indent=2))
    return 0


def _cmd_bench_agreement(args: argparse.Namespace) -> int:
    from cloud.bench.agreement import run
    from ctxfuse.engine_cli import engine_config

    print(json.dumps(run(engine_config(args), max_tokens=args.max_tokens), indent=2))
    return 0


def _cmd_bench_gateway(args: argparse.Namespace) -> int:
    if args.fleet:
        from gateway.bench.router_overhead import RouterBenchOptions
        from gateway.bench.router_overhead import run as run_fleet

        fleet = RouterBenchOptions(
            duration_s=args.duration,
            prompt_tokens=tuple(args.prompt_tokens),
            connections=args.connections,
            fleet_connections=args.fleet_connections,
            kinds=tuple(args.fleet_backends),
        )
        print(json.dumps(run_fleet(fleet), indent=2))
        return 0
    from gateway.bench.run import GatewayBenchOptions, run

    options = GatewayBenchOptions(
        duration_s=args.duration,
        connections=args.connections,
        steps=tuple(sorted(set(args.steps))),
        p99_budget_ms=args.p99_budget_ms,
        compare_unlimited=args.compare_unlimited,
    )
    print(json.dumps(run(options), indent=2))
    return 0


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError("counts must be >= 1")
    return counts


def _kinds(text: str) -> list[str]:
    from gateway.bench.router_overhead import KINDS

    kinds = [k.strip() for k in text.split(",") if k.strip()]
    if not kinds or set(kinds) - set(KINDS):
        raise argparse.ArgumentTypeError(f"expected some of {','.join(KINDS)}, got {text!r}")
    return kinds


def add_bench_gateway_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ctxfuse.cli_values import positive_int
    from gateway.bench.router_overhead import RouterBenchOptions
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
        type=_counts,
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
    bg.add_argument(
        "--compare-unlimited",
        action="store_true",
        help="also measure the same gateway on uvicorn's httptools without connection limits, side by "
        "side (what the limits cost)",
    )
    r = RouterBenchOptions()
    bg.add_argument(
        "--fleet",
        action="store_true",
        help="measure the fleet router instead (`ctxfuse serve --backend URL`) in front of an "
        "OpenAI-compatible server that answers at once, beside that server reached directly: latency "
        "added at --connections, requests/s at --fleet-connections, plain and streamed chats of each "
        "--prompt-tokens size, against issue 30's aims (--steps, --p99-budget-ms and "
        "--compare-unlimited do not apply)",
    )
    bg.add_argument(
        "--prompt-tokens",
        type=_counts,
        default=list(r.prompt_tokens),
        help="with --fleet: the chats' prompt sizes, about this many tokens each "
        f"(default {','.join(map(str, r.prompt_tokens))})",
    )
    bg.add_argument(
        "--fleet-connections",
        type=positive_int,
        default=r.fleet_connections,
        help=f"with --fleet: connections for the requests/s figure (default {r.fleet_connections})",
    )
    bg.add_argument(
        "--fleet-backends",
        type=_kinds,
        default=",".join(r.kinds),
        help="with --fleet: the backends measured, comma-separated: openai (a relayed OpenAI-compatible "
        "server) and worker (a ctxfuse worker behind the engine seam) (default %(default)s)",
    )
    bg.set_defaults(func=_cmd_bench_gateway)


def _add_models(p: argparse.ArgumentParser) -> None:
    f = p.add_subparsers(dest="models_command", required=True).add_parser(
        "fetch",
        help="fetch the default model and build the image encoder's files in the cache"
        " (CTXFUSE_HOME or ~/.cache/ctxfuse)",
    )
    f.add_argument("--quiet", action="store_true")
    f.set_defaults(func=_cmd_models_fetch)


def _add_generate(p: argparse.ArgumentParser) -> None:
    from ctxfuse.engine_cli import add_engine_options

    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    add_engine_options(p)
    p.set_defaults(func=_cmd_generate)


def _add_serve(p: argparse.ArgumentParser) -> None:
    from ctxfuse.serve_cli import add_serve_parser

    add_serve_parser(p)


def _add_worker(p: argparse.ArgumentParser) -> None:
    from ctxfuse.worker_cli import add_worker_parser

    add_worker_parser(p)


def _add_edge(p: argparse.ArgumentParser) -> None:
    from ctxfuse.edge_cli import add_edge_parser

    add_edge_parser(p)


def _add_certs(p: argparse.ArgumentParser) -> None:
    from ctxfuse.certs_cli import add_certs_parser

    add_certs_parser(p)


def _add_keys(p: argparse.ArgumentParser) -> None:
    from ctxfuse.keys_cli import add_keys_parser

    add_keys_parser(p)


def _add_bench(p: argparse.ArgumentParser) -> None:
    from cloud.bench.gpu_check import add_gpu_check_parser
    from cloud.bench.kv_layout import add_kv_layout_parser
    from cloud.bench.kv_tiers import add_kv_tiers_parser
    from cloud.bench.longctx import add_longctx_parser
    from cloud.bench.prefill_cap import add_prefill_cap_parser
    from cloud.bench.schemabench import add_schemas_parser
    from cloud.bench.speculative import add_speculative_parser
    from cloud.bench.step_profile import add_step_profile_parser
    from cloud.bench.structured_bench import add_structured_parser
    from ctxfuse.engine_cli import add_engine_options
    from gateway.bench.edge.cli import add_edge_bench_parser
    from gateway.bench.fleet_bench import add_fleet_bench_parser
    from gateway.bench.router_keys import add_router_keys_bench_parser
    from gateway.bench.serving import add_serve_bench_parser
    from gateway.bench.shared_state import add_shared_state_bench_parser

    bench = p.add_subparsers(dest="bench_command", required=True)
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
    add_fleet_bench_parser(bench)
    add_router_keys_bench_parser(bench)
    add_shared_state_bench_parser(bench)
    add_longctx_parser(bench)
    add_prefill_cap_parser(bench)
    add_speculative_parser(bench)
    add_kv_tiers_parser(bench)
    add_kv_layout_parser(bench)
    add_structured_parser(bench)
    add_schemas_parser(bench)
    add_edge_bench_parser(bench)
    add_gpu_check_parser(bench)
    add_serve_bench_parser(bench)
    add_step_profile_parser(bench)


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str  # its line in `ctxfuse --help`
    extra: str  # the install extra it needs: "cloud" or "edge"
    add: Callable[[argparse.ArgumentParser], None]  # its options; imports its component


COMMANDS = (
    Command("models", "fetch the default model and build the image encoder's files", "cloud", _add_models),
    Command("generate", "answer one chat prompt with the engine (a quick check)", "cloud", _add_generate),
    Command(
        "serve",
        "the OpenAI-compatible gateway with an in-process engine (default model on 127.0.0.1:8000), "
        "or a router over workers (--backend, --fleet)",
        "cloud",
        _add_serve,
    ),
    Command(
        "worker",
        "an engine for a routing gateway: the OpenAI API and internal state (127.0.0.1:8001)",
        "cloud",
        _add_worker,
    ),
    Command(
        "edge",
        "the device agent: a local OpenAI proxy that uploads only what the cloud lacks",
        "edge",
        _add_edge,
    ),
    Command(
        "certs",
        "certificates for the gateway's edge listener (mutual TLS): CA, server, devices, revocation",
        "edge",
        _add_certs,
    ),
    Command(
        "keys",
        "tenants' API keys for the gateway: create, list, rotate, revoke (stored hashed)",
        "cloud",
        _add_keys,
    ),
    Command("bench", "benchmarks", "cloud", _add_bench),
)


_OURS = ("ctxfuse", "gateway", "edge", "cloud", "shared", "kernels")


class MissingExtra(Exception):
    def __init__(self, command: Command, module: str) -> None:
        super().__init__(
            f"`ctxfuse {command.name}` needs `pip install 'ctxfuse[{command.extra}]'` "
            f"(the module {module!r} is not installed)"
        )


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line (`commands` None), or one where only the named commands are built in
    full and the others are only their help lines, which import nothing."""
    parser = argparse.ArgumentParser(
        prog="ctxfuse", description="Long-context LLM serving with an edge-cloud split."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for c in COMMANDS:
        p = sub.add_parser(c.name, help=c.help)
        if commands is not None and c.name not in commands:
            continue
        try:
            c.add(p)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] in _OURS:
                raise  # a bug of ours, not a missing extra
            raise MissingExtra(c, exc.name or "?") from exc
    return parser


# PyTorch's OpenMP threads spin for a while after each of its parallel ops; on a CPU with few cores
# that spinning takes the cores our compiled kernels' own pool needs between two ops (a decode step
# of the default model ran at ~70 tok/s with libgomp's default spin, ~120 with a short one). Set
# before torch is imported (libgomp reads it once); a user's own setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    named = [a for a in argv if not a.startswith("-")][:1]  # the command run (none for --help)
    try:
        args = build_parser(named).parse_args(argv)
        try:
            return int(args.func(args))
        except ModuleNotFoundError as exc:  # e.g. `serve` with an engine in a router's environment
            if (exc.name or "").split(".")[0] in _OURS:
                raise
            raise MissingExtra(next(c for c in COMMANDS if c.name == args.command), exc.name or "?") from exc
    except KeyboardInterrupt:
        return 130
    except MissingExtra as exc:
        print(f"ctxfuse: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from shared.errors import CtxfuseError

        if isinstance(exc, CtxfuseError):  # one line, no traceback (a StorageFault's names the file)
            print(f"ctxfuse: {getattr(exc, 'operator_message', exc.message)}", file=sys.stderr)
            return 2
        raise
