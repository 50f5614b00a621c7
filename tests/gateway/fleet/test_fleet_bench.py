"""`ctxfuse bench fleet` at tiny sizes: two real workers, the three policies in one run, and a report
that is complete and sane (every request answered, TTFTs positive, prefix routing found its prefixes)."""

from __future__ import annotations

import json
from pathlib import Path

from cloud.model.text_side import load_text_side
from gateway.bench.fleet_bench import POLICIES, FleetBenchOptions, run
from gateway.bench.fleet_workload import workload


def test_the_workload_interleaves_users_and_gives_every_phase_its_own_documents(gguf_path: Path) -> None:
    tokenizer, _ = load_text_side(gguf_path)
    first = workload(tokenizer, users=3, questions_per_user=4, prefix_tokens=120, seed=0, phase=0)
    again = workload(tokenizer, users=3, questions_per_user=4, prefix_tokens=120, seed=0, phase=0)
    other = workload(tokenizer, users=3, questions_per_user=4, prefix_tokens=120, seed=0, phase=1)
    assert first == again  # seeded
    assert len(first) == 12 and len({(q.user, q.text) for q in first}) == 12
    assert [q.user for q in first] != sorted(q.user for q in first)  # shuffled across users
    docs = {q.user: q.document for q in first}
    assert len(set(docs.values())) == 3 and not set(docs.values()) & {q.document for q in other}
    for doc in docs.values():
        assert 110 <= len(tokenizer.encode(doc)) <= 160


def test_a_tiny_fleet_bench_reports_every_policy_completely(gguf_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    options = FleetBenchOptions(
        users=2, questions=3, prefix_tokens=200, concurrency=2, kv_cache_gib=0.1, model=gguf_path, out=out
    )
    result = run(options)
    assert [p.policy for p in result.phases] == list(POLICIES) and sorted(result.order) == sorted(POLICIES)
    for p in result.phases:
        assert (p.requests, p.failed, p.errors) == (6, 0, []), p
        assert 0 < p.ttft_p50_ms <= p.ttft_p90_ms <= p.ttft_max_ms
        assert p.throughput_rps > 0 and 0 <= p.cached_share < 1
        assert sum(p.decisions.values()) == 6
    prefix = result.phases[POLICIES.index("prefix")]
    assert prefix.decisions.get("affinity_hit", 0) >= 1 and prefix.cached_share > 0
    assert result.phases[POLICIES.index("random")].decisions == {"random": 6}
    data = json.loads(out.read_text())
    assert data["aim_met"] == result.aim_met and "| prefix |" in data["table"]
    assert data["random_over_prefix_p90"] == result.random_over_prefix_p90 > 0
