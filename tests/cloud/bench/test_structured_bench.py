"""`ctxfuse bench structured` at its smallest sizes: every figure is reported, both decode sides
generate exactly the asked tokens and end by length, the results are JSON, and the command line
shows its options. No timing is asserted."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import pytest

from cloud.bench.structured_bench import add_structured_parser
from cloud.bench.structured_results import FULL, QUICK, Sizes
from cloud.bench.structured_run import run
from cloud.bench.structured_schemas import SCHEMAS
from cloud.engine.config import EngineConfig
from cloud.model.loading import LoadedModel

TINY = Sizes(schemas=3, compile_repeats=1, cached_lookups=2, tokens=4, repeats=1, concurrency=(1, 2))
CONFIG = EngineConfig(dtype="float32", weight_quant="none", kv_cache_memory_gib=0.25, max_model_len=1024)


def test_the_smallest_run_reports_every_figure_and_both_sides_end_by_length(
    loaded_model: LoadedModel,
) -> None:
    report = run(CONFIG, TINY, loaded_model)

    c = report.compile
    assert (c.cold_ms.n, c.cached_us.n) == (3, 3 * 2)
    assert (c.cache_misses, c.cache_hits) == (3, 6)  # every cold compile missed, every lookup hit
    assert len(c.slowest_ms) == 3 and set(c.slowest_ms) <= set(SCHEMAS)

    assert [d.concurrency for d in report.decode] == [1, 2]
    for d in report.decode:
        # every request of both sides: finish "length" with exactly TINY.tokens tokens
        assert d.constrained_ended_by_length and d.unconstrained_ended_by_length
        assert len(d.unconstrained_runs) == len(d.constrained_runs) == TINY.repeats
        assert d.unconstrained_tok_s > 0 and d.constrained_tok_s > 0 and d.ratio > 0
        decode_steps = TINY.tokens - 1  # the first token comes with prefill, outside the clock
        assert d.constrained_step_ms.n == d.mask_us_per_step.n == decode_steps
        assert d.accept_us_per_token.n == decode_steps * d.concurrency
        assert 0 < d.mask_share_of_step < 1
    assert "at concurrency 2" in report.goal and report.warnings == []
    assert report.engine.config == "custom" and report.machine.torch_threads >= 1
    assert json.loads(json.dumps(asdict(report)))["sizes"]["tokens"] == TINY.tokens


def test_sizes_refuse_a_run_with_no_decode_step() -> None:
    with pytest.raises(ValueError):
        Sizes(schemas=3, compile_repeats=1, cached_lookups=1, tokens=1, repeats=1, concurrency=(1,))


def test_the_command_line_takes_quick_tokens_repeats_and_out() -> None:
    parser = argparse.ArgumentParser()
    add_structured_parser(parser.add_subparsers(dest="bench_command"))
    args = parser.parse_args(["structured", "--quick", "--tokens", "7", "--repeats", "3", "--out", "x.json"])
    assert (args.quick, args.tokens, args.repeats, str(args.out)) == (True, 7, 3, "x.json")
    assert callable(args.func)
    defaults = parser.parse_args(["structured"])
    assert (defaults.dtype, defaults.weight_quant) == (EngineConfig().dtype, EngineConfig().weight_quant)
    assert str(defaults.out) == "bench-results/structured.json"
    assert QUICK.tokens < FULL.tokens and len(SCHEMAS) >= 30
