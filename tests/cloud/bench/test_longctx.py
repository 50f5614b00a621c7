"""The long-context harness: which engines each configuration needs, how its engine is configured,
how the command line reads, and how the summary compares configurations (matched cases only)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import msgspec
import pytest
import torch

from cloud.bench.longctx import FULL_GRID, QUICK_GRID, add_longctx_parser, options
from cloud.bench.longctx_configs import CONFIGS, Grid, engine_config, plan
from cloud.bench.longctx_results import CaseResult
from cloud.bench.longctx_run import LongCtxOptions, Report, run
from cloud.bench.longctx_summary import mark_agreement, summarise
from cloud.bench.longctx_worker import TimedAttention
from cloud.engine.config import EngineConfig


def test_long_cases_get_their_own_yarn_engine_with_the_scaled_context() -> None:
    short, long = plan(CONFIGS["dense"], FULL_GRID)
    assert (short.rope_scaling, short.max_model_len) == (None, 8192)
    assert {s.length for s in short.specs} == {2048, 4096, 8192}
    assert (long.rope_scaling, long.max_model_len) == ({"type": "yarn", "factor": 4.0}, 32768)
    assert {s.length for s in long.specs} == {16384, 32768}
    assert len(short.specs) + len(long.specs) == 5 * 5 * 2


def test_the_no_yarn_variant_runs_only_up_to_twice_the_native_context() -> None:
    (only,) = plan(CONFIGS["dense-noyarn"], FULL_GRID)
    assert (only.rope_scaling, only.max_model_len) == (None, 16384)
    assert {s.length for s in only.specs} == {16384}
    assert plan(CONFIGS["dense-noyarn"], QUICK_GRID) == []


def test_engine_config_disables_prefix_caching_and_pins_the_block_size() -> None:
    (group,) = plan(CONFIGS["sparse-1024-int4"], QUICK_GRID)
    cfg = engine_config(EngineConfig(), CONFIGS["sparse-1024-int4"], group)
    assert not cfg.enable_prefix_caching and cfg.max_num_seqs == 1
    assert (cfg.attention, cfg.sparse.budget, cfg.kv_dtype) == ("sparse", 1024, "int4")
    assert cfg.block_size == cfg.kv_block_size == 32 and cfg.max_model_len == 4096
    dense = engine_config(EngineConfig(), CONFIGS["dense"], group)
    assert (dense.attention, dense.kv_dtype, dense.block_size) == ("dense", "auto", 16)


def test_a_pruned_configuration_runs_one_engine_per_length_with_its_share_as_budget() -> None:
    groups = plan(CONFIGS["pruned-25"], FULL_GRID)
    assert [({s.length for s in g.specs}, g.rope_scaling is None, g.max_model_len) for g in groups] == [
        ({2048}, True, 8192),
        ({4096}, True, 8192),
        ({8192}, True, 8192),
        ({16384}, False, 32768),
        ({32768}, False, 32768),
    ]
    budgets = [engine_config(EngineConfig(), CONFIGS["pruned-10"], g).kv_prune_budget for g in groups]
    assert budgets == [204, 409, 819, 1638, 3276]
    assert engine_config(EngineConfig(), CONFIGS["dense"], groups[0]).kv_prune_budget is None


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_longctx_parser(parser.add_subparsers(dest="bench_command"))
    return parser.parse_args(["longctx", *argv])


def test_quick_sets_the_small_grid_and_explicit_options_win() -> None:
    args = _parse("--quick")
    assert callable(args.func)
    opts = options(args)
    assert (opts.grid.lengths, opts.grid.depths, opts.grid.tasks) == (
        (2048, 4096),
        (0, 50, 100),
        ("passkey",),
    )
    assert opts.configs == tuple(c for c in CONFIGS if c != "dense-allkv")  # dense for most models
    opts = options(_parse("--quick", "--lengths", "4K,2048", "--configs", "int4,sparse-1024"))
    assert opts.grid.lengths == (2048, 4096)
    assert opts.configs == ("dense", "int4", "sparse-1024")  # the reference always runs, first
    with pytest.raises(SystemExit):
        _parse("--configs", "dense,fp8")


def _case(config: str, depth: int, correct: bool, answer: str, prefill: float, **kw: object) -> CaseResult:
    return CaseResult(
        config=config,
        task="passkey",
        length=2048,
        depth=depth,
        sample=0,
        prompt_crc=1,
        answer=answer,
        number=answer.strip(" .") or None,
        correct=correct,
        prefill_s=prefill,
        kv_bytes_per_token=100.0 if config == "dense" else 25.0,
        **kw,  # type: ignore[arg-type]
    )


def test_summary_compares_with_the_reference_on_matched_cases_only() -> None:
    cases = [
        _case("dense", 0, True, " 12345.", 2.0),
        _case("dense", 100, True, " 12345.", 2.0),
        _case("int4", 0, True, " 12345.", 1.0),
        _case("int4", 100, False, " 54321.", 1.0),
        _case("int4", 50, True, " 1.", 9.0),  # no dense counterpart: in the figures, not the ratios
        _case("int4", 25, False, "", 0.0, error="boom"),
    ]
    mark_agreement(cases, "dense")
    s = summarise(cases, {"dense": 1000.0, "int4": 500.0}, "dense")
    int4 = s["int4"]
    assert (int4.figures.cases, int4.figures.errors) == (3, 1)
    assert int4.figures.accuracy == pytest.approx(2 / 3, abs=1e-4)  # figures keep 4 significant digits
    assert int4.figures.agreement_text == 0.5 and int4.figures.agreement_number == 0.5
    vs = int4.vs_reference
    assert vs is not None and vs.matched_cases == 2
    assert (vs.accuracy, vs.accuracy_minus_reference) == (0.5, -0.5)
    assert (vs.prefill_s, vs.kv_bytes_per_token, vs.peak_rss_mib) == (0.5, 0.25, 0.5)
    assert int4.grid == {"passkey": {2048: {0: 1.0, 25: None, 50: 1.0, 100: 0.0}}}
    assert s["dense"].vs_reference is not None and s["dense"].vs_reference.prefill_s == 1.0


def test_timed_attention_passes_calls_through_and_adds_up_their_time() -> None:
    class Backend:
        name = "fake"

        def __call__(self, layer: int, q: torch.Tensor, *rest: object) -> torch.Tensor:
            time.sleep(0.01)
            return q * layer

    timed = TimedAttention(Backend())
    q = torch.ones(2, 3)
    assert torch.equal(timed(2, q, "cache", "meta"), q * 2)
    assert torch.equal(timed(3, q, "k", "v", "cache", "meta"), q * 3)
    assert timed.name == "fake"
    assert timed.take() >= 0.02 and timed.take() == 0.0


def test_a_run_drives_a_worker_process_and_writes_json_and_heatmaps(tmp_path: Path) -> None:
    grid = Grid(("passkey",), (512,), (50,))
    opts = LongCtxOptions(configs=("dense",), grid=grid, max_tokens=4, out=tmp_path)
    report = run(opts)
    (case,) = report.cases
    assert case.error is None and case.prompt_tokens == pytest.approx(512 - 4, abs=4)
    assert case.prefill_s is not None and case.prefill_attention_s is not None
    assert case.decode_tokens == 3 and case.decode_attention_ms_per_token is not None
    assert case.agrees_text is True  # the reference agrees with itself
    dense = report.configs["dense"]
    assert dense.status == "ok" and dense.peak_rss_mib and dense.engines[0].max_model_len == 512
    assert Path(dense.heatmap or "").is_file()
    again = msgspec.json.decode((tmp_path / "results.json").read_bytes(), type=Report)
    assert again.cases == report.cases and again.summary == report.summary
