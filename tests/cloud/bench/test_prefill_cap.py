"""`ctxfuse bench prefill-cap` on a tiny case: both configurations run the same rounds, the capped
one computes the long prompt in more (smaller) steps while the short ones run, and the results
file holds the figures the table prints."""

from __future__ import annotations

import json
from pathlib import Path

from cloud.bench.prefill_cap import CapOptions, run, table


def test_a_tiny_prefill_cap_run(loaded_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    opts = CapOptions(
        long_tokens=96,
        shorts=2,
        short_tokens=8,
        max_tokens=2,
        cap=16,
        budget=64,
        rounds=2,
        out=tmp_path / "r.json",
    )
    result = run(opts, loaded_model)
    rounds = result["rounds"]
    assert isinstance(rounds, dict) and set(rounds) == {"0", "16"}
    assert all(len(rs) == 2 and all(len(r["short_ttft_s"]) == 2 for r in rs) for rs in rounds.values())
    # uncapped: 64 + 32 tokens of the long prompt; capped: 64, then 16 a step while the shorts run
    assert min(r["steps"] for r in rounds["16"]) > max(r["steps"] for r in rounds["0"])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["cap"]["steps_mean"] == result["cap"]["steps_mean"]  # type: ignore[index]
    assert "| cap 16 |" in table(result)
