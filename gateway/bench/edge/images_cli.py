"""`ctxfuse bench edge --images`: its own options and the printed table; the measuring is in openai/images.py.
cli.py owns the `edge` parser and hands over when `--images` is given."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from cloud.bench.report import publish
from gateway.bench.edge.images import ImageBenchOptions, ImageReport, run
from shared.errors import CtxfuseError

DEFAULT_OUT = Path("bench-results/edge-images.json")


def _encoder_table(r: ImageReport) -> list[str]:
    e, o = r.encoder, r.options
    lines = [
        f"## Encoder on the device: {o.image_requests} timed images per precision and case after "
        f"{o.warmup} warm-up, interleaved, onnxruntime with {e.threads} thread",
        "",
        "| precision | encoder alone, 224x224 picture p50 / p99 (ms) "
        "| pipeline, 1-MP JPEG (decode + encode) p50 / p99 (ms) |",
        "|---|---:|---:|",
    ]
    for t in e.times:
        lines.append(
            f"| {t.precision} | {t.encoder_ms.p50:.2f} / {t.encoder_ms.p99:.2f} "
            f"| {t.pipeline_ms.p50:.2f} / {t.pipeline_ms.p99:.2f} |"
        )
    lines += [
        f"| **int8 speed-up** (fp32 p50 / int8 p50) | **{e.encoder_speedup:.2f}x** "
        f"| **{e.pipeline_speedup:.2f}x** |",
        "",
        f"fp32 against int8 over {e.pictures} pictures: same top-1 label on {e.top1_agreement:.0%} "
        f"({e.clear_top1_agreement:.0%} of the {e.clear_pictures} with a clear fp32 answer; int8's top-1 in "
        f"fp32's top 5 on {e.top1_in_fp32_top5:.0%}); "
        f"embedding cosine mean {e.cosine_mean:.4f}, least {e.cosine_min:.4f}",
    ]
    return lines


def _costs_table(r: ImageReport) -> list[str]:
    c, o = r.costs.chunking, r.options
    lines = [
        f"## The agent's other CPU costs, in this process alone: {o.cost_repeats} timed rounds after one "
        "untimed, side by side",
        "",
        f"chunking a {c.tokens:,}-token document ({c.bytes:,} bytes, {c.chunks} chunks); the numpy path "
        f"gives the reference's boundaries: {'yes' if c.agree else 'NO'}",
        "",
        "| chunk_boundaries | per document p50 / p99 (ms) | MB/s at p50 |",
        "|---|---:|---:|",
        f"| numpy | {c.numpy_ms.p50:.2f} / {c.numpy_ms.p99:.2f} | {c.numpy_mb_s:,.1f} |",
        f"| per-byte reference | {c.reference_ms.p50:.2f} / {c.reference_ms.p99:.2f} "
        f"| {c.reference_mb_s:,.1f} |",
        f"| **numpy speed-up** (reference p50 / numpy p50) | **{c.speedup:.1f}x** | |",
        "",
        "| looks_like_document on | document | p50 / p99 (ms) |",
        "|---|:-:|---:|",
    ]
    for t in r.costs.document_test:
        lines.append(f"| {t.name} | {'yes' if t.document else 'no'} | {t.ms.p50:.2f} / {t.ms.p99:.2f} |")
    ocr = r.costs.ocr
    lines += [
        "",
        f"| OcrReader.read, document page {ocr.width}x{ocr.height} | first read, loads the models (ms) "
        f"| {o.ocr_reads} reads after it p50 / p99 (ms) | characters read |",
        "|---|---:|---:|---:|",
        f"| a fresh reader | {ocr.first_ms:,.0f} | {ocr.warm_ms.p50:,.0f} / {ocr.warm_ms.p99:,.0f} "
        f"| {ocr.chars:,} |",
    ]
    return lines


def _link_table(r: ImageReport) -> list[str]:
    lines = [
        "## Bytes on the link: one chat request with one image, through the agent",
        "",
        "| image | OCR | image (bytes) | plain OpenAI JSON, data URL (bytes) | on the link (bytes) "
        "| **image / link** |",
        "|---|:-:|---:|---:|---:|---:|",
    ]
    for c in r.link:
        lines.append(
            f"| {c.name} | {'yes' if c.ocr else 'no'} | {c.raw_bytes:,} | {c.plain_bytes:,} "
            f"| {c.link_bytes:,} | **{c.ratio:.0f}x** |"
        )
    return lines


def _outbox_table(r: ImageReport) -> list[str]:
    b = r.outbox
    return [
        f"## Batch outbox: {b.batches} batches of {b.requests_per_batch} chat requests "
        f"({b.file_bytes:,}-byte JSONL each), one client",
        "",
        "| accept one batch (upload + create) p50 / p99 (ms) | accepted per second "
        "| end to end, all batches (s) | completed | result lines |",
        "|---:|---:|---:|---:|---:|",
        f"| {b.accept_ms.p50:.1f} / {b.accept_ms.p99:.1f} | {b.accepted_per_s:.1f} | {b.end_to_end_s:.2f} "
        f"| {b.completed} / {b.batches} | {b.result_lines:,} |",
        "",
        f"the agent looked at forwarded batches every {b.poll_s:g} s, doubling up to {b.poll_max_s:g} s "
        "(EdgeConfig.poll_s / poll_max_s)",
    ]


def table(r: ImageReport) -> str:
    notes = [f"aim: {a}" for a in r.aims] + [f"engine: {r.engine}", f"network: {r.network}"]
    sections = [_encoder_table(r), _costs_table(r), _link_table(r), _outbox_table(r), notes]
    return "\n\n".join("\n".join(s) for s in sections)


def cmd_edge_images(args: argparse.Namespace) -> int:
    from gateway.ops.logs import configure_logging

    try:
        options = ImageBenchOptions(
            image_requests=args.image_requests,
            warmup=args.warmup,
            batches=args.batches,
            batch_requests=args.batch_requests,
            tokens=args.tokens,
            cost_repeats=args.cost_repeats,
            ocr_reads=args.ocr_reads,
            seed=args.seed,
        )
    except ValueError as exc:
        raise CtxfuseError(str(exc)) from None
    configure_logging("warning")  # the agent's forwarder lines would bury the table
    report = run(options)
    publish(args.out or DEFAULT_OUT, asdict(report), table(report))
    return 0


def add_image_options(p: argparse.ArgumentParser) -> None:
    """The options only `--images` reads; --tokens, --warmup, --seed and --out are shared with the text
    bench."""
    d = ImageBenchOptions()
    p.add_argument(
        "--images",
        action="store_true",
        help="measure images instead: encoder latency fp32 against INT8, the agent's chunking, document "
        "test and OCR times, bytes on the link against the image, and the batch outbox's throughput "
        f"(JSON default {DEFAULT_OUT})",
    )
    p.add_argument(
        "--image-requests",
        type=int,
        default=d.image_requests,
        help="--images: timed images per precision and case (default %(default)s)",
    )
    p.add_argument(
        "--batches",
        type=int,
        default=d.batches,
        help="--images: batches put through the agent's outbox (default %(default)s)",
    )
    p.add_argument(
        "--batch-requests",
        type=int,
        default=d.batch_requests,
        help="--images: chat requests in each batch (default %(default)s)",
    )
    p.add_argument(
        "--cost-repeats",
        type=int,
        default=d.cost_repeats,
        help="--images: timed rounds of chunking (numpy and reference) and of the document test "
        "(default %(default)s)",
    )
    p.add_argument(
        "--ocr-reads",
        type=int,
        default=d.ocr_reads,
        help="--images: timed OCR reads of the document page after the first (default %(default)s)",
    )
