"""The long-context harness: which engines each configuration needs, how its engine is configured,
how the command line reads, and how the summary compares configurations (matched cases only)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import msgspec
import pytest
import torch

from cloud.bench.heatmap import HeatmapPanel, render_heatmap, size_px
from cloud.bench.longctx import FULL_GRID, QUICK_GRID, add_longctx_parser, options
from cloud.bench.longctx_configs import ABLATIONS, CONFIGS, Grid, engine_config, plan
from cloud.bench.longctx_data import TASKS, Task
from cloud.bench.longctx_probe import probe_report
from cloud.bench.longctx_results import CaseResult
from cloud.bench.longctx_run import LongCtxOptions, Report, run
from cloud.bench.longctx_summary import EffectiveLength, effective_length, mark_agreement, summarise
from cloud.bench.longctx_worker import TimedAttention
from cloud.engine.attention.sparse_probe import LayerTrace
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


def test_an_eighth_of_the_context_is_each_lengths_own_sparse_budget() -> None:
    groups = plan(CONFIGS["sparse-eighth-duo"], FULL_GRID)
    sparse = [engine_config(EngineConfig(), CONFIGS["sparse-eighth-duo"], g).sparse for g in groups]
    # 2K's eighth (256) cannot hold the sinks (64) and the window (256): the least budget that can
    assert [s.budget for s in sparse] == [352, 512, 1024, 2048, 4096]
    assert {(s.select, s.dense_layers) for s in sparse} == {("group", 2)}
    head = engine_config(EngineConfig(), CONFIGS["sparse-eighth-head"], groups[2]).sparse
    dense8 = engine_config(EngineConfig(), CONFIGS["sparse-eighth-dense8"], groups[2]).sparse
    assert (head.select, head.budget, dense8.dense_layers, dense8.budget) == ("head", 1024, 8, 1024)
    assert CONFIGS["sparse-eighth-duo"].retrieval and not CONFIGS["sparse-eighth"].retrieval


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
    # dense-allkv is dense for most models; the selection ablations run when asked for
    assert opts.configs == tuple(c for c in CONFIGS if c != "dense-allkv" and c not in ABLATIONS)
    assert "sparse-eighth-duo" in ABLATIONS and "sparse-1024" in opts.configs
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


def _scored(config: str, length: int, hits: int, of: int = 10, task: Task = "needle") -> list[CaseResult]:
    """`of` cases of one task and length, the first `hits` of them correct."""
    return [
        CaseResult(config=config, task=task, length=length, depth=d, sample=0, correct=d < hits)
        for d in range(of)
    ]


def test_effective_length_is_the_longest_length_up_to_which_accuracy_holds_the_threshold() -> None:
    ref = _scored("dense", 2048, 10) + _scored("dense", 4096, 10) + _scored("dense", 8192, 10)
    # 85% of the reference's 100% at 4K: 90% holds, 50% at 8K does not
    sparse = _scored("sparse", 2048, 10) + _scored("sparse", 4096, 9) + _scored("sparse", 8192, 5)
    assert effective_length(sparse, ref, "needle") == EffectiveLength(
        threshold=0.85, base_length=4096, length=4096
    )
    assert effective_length(ref, ref, "needle").length == 8192
    never = _scored("int4", 2048, 8) + _scored("int4", 4096, 10) + _scored("int4", 8192, 10)
    assert effective_length(never, ref, "needle").length is None  # 80% at the shortest length already
    # a length whose cases all failed falls short, though a longer one holds
    failed = [CaseResult(config="cold", task="needle", length=4096, depth=0, sample=0, error="boom")]
    cold = _scored("cold", 2048, 10) + failed + _scored("cold", 8192, 10)
    assert effective_length(cold, ref, "needle").length == 2048


def test_the_threshold_is_a_share_of_the_references_own_score_at_4k_or_its_shortest_length() -> None:
    ref = _scored("dense", 2048, 10) + _scored("dense", 4096, 6) + _scored("dense", 16384, 2)
    mine = _scored("int8", 2048, 6) + _scored("int8", 4096, 6) + _scored("int8", 16384, 5)
    got = effective_length(mine, ref, "needle")
    assert (got.threshold, got.base_length, got.length) == (0.51, 4096, 4096)  # 85% of 60%
    short = _scored("dense", 1024, 8) + _scored("dense", 2048, 10)
    got = effective_length(_scored("int8", 1024, 7) + _scored("int8", 2048, 7), short, "needle")
    assert (got.threshold, got.base_length, got.length) == (0.68, 1024, 2048)  # none >= 4K: the shortest
    # no threshold where the reference scored nothing, or did not run the task
    zero = _scored("dense", 4096, 0)
    assert effective_length(mine, zero, "needle") == EffectiveLength(
        threshold=None, base_length=4096, length=None
    )
    assert effective_length(mine, ref, "cwe") == EffectiveLength(
        threshold=None, base_length=None, length=None
    )


def test_a_list_tasks_effective_length_takes_rulers_partial_score_not_the_exact_accuracy() -> None:
    """cwe answered with 4 of its 10 words at 4K and 16K and none at 32K: no case is exactly right,
    but the score (RULER's share of the items held) holds to 16K."""

    def cwe(config: str, length: int, share: float) -> list[CaseResult]:
        return [
            CaseResult(
                config=config, task="cwe", length=length, depth=d, sample=0, score=share, correct=False
            )
            for d in range(2)
        ]

    ref = cwe("dense", 4096, 0.4) + cwe("dense", 16384, 0.4) + cwe("dense", 32768, 0.0)
    assert effective_length(ref, ref, "cwe") == EffectiveLength(
        threshold=0.34, base_length=4096, length=16384
    )
    sparse = cwe("sparse", 4096, 0.4) + cwe("sparse", 16384, 0.3) + cwe("sparse", 32768, 0.4)
    assert effective_length(sparse, ref, "cwe").length == 4096  # 0.3 < 85% of 0.4
    assert summarise(ref, {"dense": 1.0}, "dense")["dense"].figures.accuracy == 0.0


def test_the_summary_holds_every_tasks_effective_length_and_grid_and_its_heatmap_wraps(
    tmp_path: Path,
) -> None:
    cases = [
        c
        for config in ("dense", "int4")
        for task in TASKS
        for c in _scored(config, 4096, 10 if config == "dense" or task == "passkey" else 0, 2, task)
    ]
    s = summarise(cases, {"dense": 1.0, "int4": 1.0}, "dense")
    assert list(s["int4"].grid) == list(TASKS) and s["int4"].grid["cwe"] == {4096: {0: 0.0, 1: 0.0}}
    lengths = {t: e.length for t, e in s["int4"].effective_length.items()}
    assert lengths == {t: 4096 if t == "passkey" else None for t in TASKS}
    assert b'"effective_length":{"passkey":{"threshold":0.85' in msgspec.json.encode(s["int4"])
    panels = [
        HeatmapPanel(t, ("4K",), tuple(f"{d}%" for d in row[4096]), tuple((v,) for v in row[4096].values()))
        for t, row in s["int4"].grid.items()
    ]
    path = tmp_path / "heatmap.png"
    render_heatmap(path, "int4", panels)
    head = path.read_bytes()[16:24]
    assert size_px(7) == (2000, 800)  # two rows of at most four panels
    assert (int.from_bytes(head[:4], "big"), int.from_bytes(head[4:], "big")) == size_px(7)


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


def test_the_probe_table_puts_found_cases_beside_lost_ones_and_names_where_the_needle_was_dropped() -> None:
    def trace(selected: float, needle: float) -> list[LayerTrace]:
        return [
            LayerTrace(layer=2, kv_heads=3, prefill_selected=3, prefill_rank=0, decode_selected=1.0),
            LayerTrace(
                layer=7, kv_heads=3, prefill_selected=1, prefill_rank=40, decode_selected=selected,
                decode_rank=40, decode_needle_mass=needle, decode_mass_kept=0.5,
            ),
        ]  # fmt: skip

    found = _case("sparse-1024", 50, True, "123", 1.0, trace=trace(0.9, 0.6))
    lost = _case("sparse-1024", 75, False, "9", 1.0, trace=trace(0.1, 0.6))
    unprobed = _case("dense", 50, True, "123", 1.0)
    table = probe_report("sparse-1024", [found, lost, unprobed])
    assert table is not None and probe_report("dense", [unprobed]) is None
    assert "## found (1 cases)" in table and "## lost (1 cases)" in table
    assert "| 7 | 33% | 40 |" in table  # the layer's row: a third of the KV heads, rank 40
    missed = "layers whose heads look at the needle but whose selection mostly missed it"
    assert f"75% (lost, answer '9'): {missed}: 7\n" in table
    assert f"50% (found, answer '123'): {missed}: none\n" in table
