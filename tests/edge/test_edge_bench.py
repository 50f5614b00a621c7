"""`ctxfuse bench edge` in its smallest configuration: the report holds every figure, later requests
send the document by reference only, and the table and JSON come out; with `--images`, both encoder
precisions are timed, the numpy chunker gives its reference's boundaries, the document test and OCR
are timed, every image is smaller on the link than itself, and every batch completes. No timing's
value is asserted, only that each is there and a positive, finite number."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import pytest

from cloud.bench.structured_results import Spread
from ctxfuse.cli import main
from gateway.bench.edge.cli import table
from gateway.bench.edge.images import ImageBenchOptions, ImageReport
from gateway.bench.edge.images import run as run_images
from gateway.bench.edge.images_cli import table as image_table
from gateway.bench.edge.run import EdgeBenchOptions, Report, run

SMALL = EdgeBenchOptions(tokens=2048, questions=3, latency_requests=10, warmup=2)


@pytest.fixture(scope="module")
def report() -> Report:
    return run(SMALL)


def test_later_requests_send_the_document_by_reference_only(report: Report) -> None:
    wire = report.wire
    assert 1900 <= wire.document.tokens <= 2048
    assert wire.document.distinct_share > 0.9  # the document does not repeat itself
    assert len(wire.requests) == 3 and len({q.question for q in wire.requests}) == 3
    first, *later = wire.requests
    assert first.link_bytes < first.plain_bytes and wire.first_compression > 1.5
    for q in later:
        assert q.link_bytes < 0.25 * first.link_bytes  # only the chunk with the question is new
        assert q.fewer > 0.8
    assert wire.later_fewer_min == min(q.fewer for q in later)


def test_latency_is_reported_for_both_paths_of_both_cases(report: Report) -> None:
    assert len(report.latency) == 2 and report.latency[0].name == "short prompt"
    assert report.latency[1].body_bytes > 8000 > report.latency[0].body_bytes
    for case in report.latency:
        assert case.direct_ms.n == case.agent_ms.n == 10
        assert case.added_p50_ms == case.agent_ms.p50 - case.direct_ms.p50
    assert len(report.aims) == 2


def test_the_table_and_the_json_hold_the_figures(report: Report) -> None:
    printed = table(report)
    assert "| request | plain OpenAI JSON (bytes) |" in printed and "added p50 / p99" in printed
    assert printed.count("\n| ") >= 3 + 1 + 2  # requests, the mean, the latency cases
    data = json.loads(json.dumps(asdict(report)))
    assert data["options"]["tokens"] == 2048 and len(data["wire"]["requests"]) == 3


def test_a_document_too_small_to_chunk_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "edge", "--tokens", "100", "--out", "/nonexistent/edge.json"]) == 2
    assert "--tokens must be at least 1024" in capsys.readouterr().err


SMALL_IMAGES = ImageBenchOptions(
    image_requests=3, warmup=1, batches=2, batch_requests=2, tokens=2048, cost_repeats=2, ocr_reads=1
)


def _sane(s: Spread, n: int) -> bool:
    return s.n == n and all(math.isfinite(x) and x > 0 for x in (s.p50, s.p99, s.max))


@pytest.fixture(scope="module")
def image_report() -> ImageReport:
    return run_images(SMALL_IMAGES)


def test_image_bench_times_both_precisions_and_images_shrink_on_the_link(image_report: ImageReport) -> None:
    enc = image_report.encoder
    assert enc.threads == 1 and [t.precision for t in enc.times] == ["fp32", "int8"]
    for t in enc.times:
        assert t.encoder_ms.n == t.pipeline_ms.n == 3 and t.encoder_ms.p50 > 0 and t.pipeline_ms.p50 > 0
    assert enc.encoder_speedup > 0 and 0.9 < enc.cosine_min <= enc.cosine_mean
    # INT8 keeps every clear fp32 answer; a near-tie may flip, but only to fp32's own top five
    assert enc.pictures == 10 and enc.clear_pictures >= enc.pictures // 2
    assert enc.clear_top1_agreement == 1.0 and enc.top1_in_fp32_top5 == 1.0
    assert enc.clear_top1_agreement * enc.clear_pictures <= enc.top1_agreement * enc.pictures
    photo, drawing, page = image_report.link
    assert not photo.ocr and not drawing.ocr and page.ocr  # only the page goes through OCR
    for case in image_report.link:
        assert case.plain_bytes > case.raw_bytes > case.link_bytes and case.ratio > 1
    assert photo.raw_bytes > 100_000 and photo.link_bytes < 2000


def test_image_bench_times_chunking_against_its_reference_the_document_test_and_ocr(
    image_report: ImageReport,
) -> None:
    c = image_report.costs.chunking
    assert c.agree and 1900 <= c.tokens <= 2048 and c.bytes > c.chunks > 1
    assert _sane(c.numpy_ms, 2) and _sane(c.reference_ms, 2)
    assert all(math.isfinite(x) and x > 0 for x in (c.numpy_mb_s, c.reference_mb_s, c.speedup))
    tested = image_report.costs.document_test
    assert [t.name for t in tested] == [case.name for case in image_report.link]
    assert [t.document for t in tested] == [False, False, True]  # as the agent decided on the link
    assert all(_sane(t.ms, 2) for t in tested)
    ocr = image_report.costs.ocr
    assert (ocr.width, ocr.height) == (1240, 1754) and ocr.chars > 100
    assert math.isfinite(ocr.first_ms) and ocr.first_ms > 0 and _sane(ocr.warm_ms, 1)


def test_image_bench_batches_all_complete_through_the_outbox(image_report: ImageReport) -> None:
    box = image_report.outbox
    assert box.completed == box.batches == 2 and box.result_lines == 2 * 2
    assert box.accept_ms.n == 2 and box.accepted_per_s > 0 and box.end_to_end_s > 0


def test_the_image_table_and_json_hold_the_figures(image_report: ImageReport) -> None:
    printed = image_table(image_report)
    assert "| fp32 |" in printed and "| int8 |" in printed and "image / link" in printed
    assert "accepted per second" in printed and len(image_report.aims) == 1
    assert "| numpy |" in printed and "| per-byte reference |" in printed and "OcrReader.read" in printed
    data = json.loads(json.dumps(asdict(image_report)))
    assert data["options"]["batches"] == 2 and len(data["link"]) == 3
    assert data["costs"]["chunking"]["agree"] is True and len(data["costs"]["document_test"]) == 3


def test_the_image_bench_refuses_an_empty_outbox_run_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "edge", "--images", "--batches", "0", "--out", "/nonexistent/x.json"]) == 2
    assert "--batches and --batch-requests must be at least 1" in capsys.readouterr().err
