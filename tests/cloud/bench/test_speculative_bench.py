"""`ctxfuse bench speculative` on a tiny case through the real engine and model: both configurations
answer the same questions at every concurrency, the greedy answers agree token for token, and the
report and its table hold the figures."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from cloud.bench.speculative import SpecOptions, run
from cloud.bench.speculative_report import table


def test_a_tiny_speculative_run_gives_identical_greedy_answers(loaded_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    opts = SpecOptions(
        doc_tokens=200, prompts=2, max_tokens=12, rounds=1, concurrency=(1, 2), out=tmp_path / "r.json"
    )
    report = run(opts, loaded_model)
    assert [x.concurrency for x in report.levels] == [1, 2]
    assert [(b.round, b.concurrency, b.config) for b in report.batches] == [
        (0, 1, "off"),
        (0, 1, "ngram"),
        (0, 2, "off"),
        (0, 2, "ngram"),
    ]
    for x in report.levels:
        assert (x.identical, x.compared, x.first_difference) == (2, 2, None)
        assert x.off.tokens == x.ngram.tokens > 0
        assert x.off.drafted == 0 and x.ngram.accepted <= x.ngram.drafted
    assert len(report.workload.answers) == 2
    assert 0 <= report.workload.document_share <= 1
    saved = json.loads(json.dumps(asdict(report)))  # what `publish` writes
    assert saved["levels"][0]["ratio"] == report.levels[0].ratio
    assert "| 2 |" in table(report)
