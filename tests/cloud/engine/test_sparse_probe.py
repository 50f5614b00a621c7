"""The sparse-selection probe (`bench longctx --probe`) on the real model: it changes no output, it
reports every sparse layer of the prompt's last query and of every decode step, and what it reports
agrees with what the selection did (a needle ranked within the picks is attended, one ranked past
them is not; a needle in the recent window is always attended)."""

from __future__ import annotations

import pytest

from cloud.bench.longctx_data import CaseSpec, Encoder, make_case
from cloud.engine.attention.sparse import SparseAttention
from cloud.engine.attention.sparse_probe import LayerTrace, SelectionProbe
from cloud.engine.config import EngineConfig, SparseConfig
from cloud.engine.core import EngineCore
from shared.engine_types import SamplingParams

MAX_TOKENS = 4
# every head sparse: the probe follows the selection (retrieval heads would prefill their layers densely)
SPARSE = SparseConfig(sinks=16, window=64, budget=256, dense_layers=2, retrieval_heads=None)
CONFIG = EngineConfig(
    dtype="float32",
    weight_quant="none",
    kv_cache_memory_gib=0.25,
    max_model_len=2048,
    max_num_batched_tokens=384,  # the prompt's last chunk starts past the budget: a sparse prefill
    enable_prefix_caching=False,
    attention="sparse",
    sparse=SPARSE,
)


def _sparse(core: EngineCore) -> SparseAttention:
    attention = core.runner.attention
    found = SparseAttention.of(attention)
    assert found is not None
    return found


def _run(core: EngineCore, ids: tuple[int, ...], probe: SelectionProbe | None, span: tuple[int, int]):  # type: ignore[no-untyped-def]
    _sparse(core).probe = probe
    if probe is not None:
        probe.begin(span, len(ids))
    core.add_request("r", list(ids), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    tokens = []
    while core.has_work():
        tokens += [t for o in core.step() for t in o.token_ids]
    return tokens, (probe.finish() if probe is not None else None)


@pytest.fixture(scope="module")
def core(loaded_model) -> EngineCore:  # type: ignore[no-untyped-def]
    return EngineCore(CONFIG, loaded_model)


def _case(core: EngineCore, depth: int):  # type: ignore[no-untyped-def]
    enc = Encoder(core.encode_chat, core.tokenizer)
    return make_case(CaseSpec("needle", 1024, depth), enc, MAX_TOKENS, seed=0)


def test_the_probe_changes_nothing_and_reports_every_sparse_layer(core: EngineCore, loaded_model) -> None:  # type: ignore[no-untyped-def]
    case = _case(core, 40)
    plain, _ = _run(core, case.prompt_ids, None, case.needle_span)
    probed, trace = _run(core, case.prompt_ids, SelectionProbe(), case.needle_span)
    assert probed == plain
    assert trace is not None
    assert [t.layer for t in trace] == list(
        range(SPARSE.dense_layers, loaded_model.weights.config.num_layers)
    )
    for t in trace:
        assert t.prefill_selected is not None and 0 <= t.prefill_selected <= t.kv_heads
        assert t.decode_steps == MAX_TOKENS - 1  # the first token comes from the prefill
        assert t.prefill_mass_kept is not None and 0 < t.prefill_mass_kept <= 1
        assert t.decode_mass_kept is not None and 0 < t.decode_mass_kept <= 1
        assert t.prefill_needle_mass is not None and 0 <= t.prefill_needle_mass <= 1


def _agrees_at_prefill(t: LayerTrace, top_blocks: int) -> bool:
    """The best rank over KV heads is within the picks exactly when some KV head attends the needle."""
    assert t.prefill_rank is not None and t.prefill_selected is not None
    return (t.prefill_rank <= top_blocks) == (t.prefill_selected > 0)


def test_what_the_probe_reports_agrees_with_the_selection(core: EngineCore) -> None:
    top = _sparse(core).top_blocks
    middle = _case(core, 30)  # far from both ends: chosen by the bound, or not
    _, trace = _run(core, middle.prompt_ids, SelectionProbe(), middle.needle_span)
    assert trace is not None
    assert all(_agrees_at_prefill(t, top) for t in trace)
    assert any(t.prefill_rank and t.prefill_rank > top for t in trace)  # this budget loses it somewhere

    end = _case(core, 100)  # right before the question: in every query's recent window
    _, trace = _run(core, end.prompt_ids, SelectionProbe(), end.needle_span)
    assert trace is not None
    for t in trace:
        assert (t.prefill_rank, t.decode_rank, t.decode_selected) == (0, 0, 1.0)
        assert t.prefill_selected == t.kv_heads
