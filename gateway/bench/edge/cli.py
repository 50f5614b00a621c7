"""`ctxfuse bench edge`: the command line and the printed table; the measuring is in run.py. With
`--images`, images_cli.py takes over."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from cloud.bench.report import publish
from gateway.bench.edge.images_cli import DEFAULT_OUT as IMAGES_OUT
from gateway.bench.edge.images_cli import add_image_options, cmd_edge_images
from gateway.bench.edge.run import EdgeBenchOptions, Report, run
from shared.errors import CtxfuseError

DEFAULT_OUT = Path("bench-results/edge.json")


def _wire_table(r: Report) -> list[str]:
    w, d = r.wire, r.wire.document
    lines = [
        f"## Bytes on the link: a {d.tokens:,}-token document ({d.bytes:,} bytes, {d.chunks} chunks, "
        f"{d.distinct_share:.0%} of its bytes in distinct chunks), {len(w.requests)} questions",
        "",
        "| request | plain OpenAI JSON (bytes) | on the link (bytes) | fewer bytes |",
        "|---|---:|---:|---:|",
    ]
    for i, q in enumerate(w.requests):
        name = "1 (first: document sent)" if i == 0 else str(i + 1)
        lines.append(f"| {name} | {q.plain_bytes:,} | {q.link_bytes:,} | {q.fewer:.1%} |")
    later = w.requests[1:]
    plain = sum(q.plain_bytes for q in later) / len(later)
    link = sum(q.link_bytes for q in later) / len(later)
    lines += [
        f"| 2-{len(w.requests)}, mean | {plain:,.0f} | {link:,.0f} | {w.later_fewer_mean:.1%} "
        f"(least {w.later_fewer_min:.1%}) |",
        "",
        f"first request: {w.first_compression:.2f}x smaller on the link than its plain JSON (zstd per chunk)",
    ]
    return lines


def _latency_table(r: Report) -> list[str]:
    o = r.options
    lines = [
        f"## Latency the agent adds: {o.latency_requests} timed requests per path and case after "
        f"{o.warmup} warm-up, interleaved",
        "",
        "| case | JSON body (bytes) | direct p50 / p99 (ms) | via agent p50 / p99 (ms) "
        "| **added p50 / p99 (ms)** |",
        "|---|---:|---:|---:|---:|",
    ]
    for c in r.latency:
        lines.append(
            f"| {c.name} | {c.body_bytes:,} | {c.direct_ms.p50:.2f} / {c.direct_ms.p99:.2f} "
            f"| {c.agent_ms.p50:.2f} / {c.agent_ms.p99:.2f} "
            f"| **{c.added_p50_ms:+.2f} / {c.added_p99_ms:+.2f}** |"
        )
    return lines


def table(r: Report) -> str:
    notes = [f"aim: {a}" for a in r.aims] + [f"engine: {r.engine}", f"network: {r.network}"]
    return "\n".join([*_wire_table(r), "", *_latency_table(r), "", *notes])


def cmd_edge(args: argparse.Namespace) -> int:
    if args.images:
        return cmd_edge_images(args)
    from gateway.ops.logs import configure_logging

    try:
        options = EdgeBenchOptions(
            tokens=args.tokens,
            questions=args.questions,
            latency_requests=args.latency_requests,
            warmup=args.warmup,
            seed=args.seed,
        )
    except ValueError as exc:
        raise CtxfuseError(str(exc)) from None
    configure_logging("warning")  # the in-process gateway's request lines would bury the table
    report = run(options)
    publish(args.out or DEFAULT_OUT, asdict(report), table(report))
    return 0


def add_edge_bench_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = EdgeBenchOptions()
    p = bench.add_parser(
        "edge",
        help="the edge link on loopback over an instant fake engine: bytes on the link per request "
        "against plain OpenAI JSON, and the latency the agent adds; prints a markdown table, writes JSON",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=d.tokens,
        help="document size in tokens, counted with the default model's tokenizer; with --images, the "
        "document whose chunking is timed (default %(default)s)",
    )
    p.add_argument(
        "--questions",
        type=int,
        default=d.questions,
        help="questions asked about the document through the agent, one request each (default %(default)s)",
    )
    p.add_argument(
        "--latency-requests",
        type=int,
        default=d.latency_requests,
        help="timed requests per path (direct, via the agent) and case (short prompt, the document) "
        "(default %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help="untimed requests per path and case before timing; with --images, untimed images per "
        "precision and case (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help="seed of the document's text (default %(default)s)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"JSON results file (default {DEFAULT_OUT}; with --images {IMAGES_OUT})",
    )
    add_image_options(p)
    p.set_defaults(func=cmd_edge)
