"""`ctxfuse bench edge` in its smallest configuration: the report holds every figure, later requests
send the document by reference only, and the table and JSON come out. No timing is asserted."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from ctxfuse.cli import main
from edge.bench.cli import table
from edge.bench.run import EdgeBenchOptions, Report, run

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
