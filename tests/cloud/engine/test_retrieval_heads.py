"""Retrieval heads on the real model: the calibration finds heads that look at the needle while the
model answers (and only learns from right answers); an engine that keeps every KV head dense through
a calibration file answers as the dense engine does, through the compiled CPU kernels, while plain
sparse attention at the same budget does not match it as closely."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cloud.bench.longctx_calibrate import calibrate_heads
from cloud.bench.longctx_data import CaseSpec, Encoder, make_case
from cloud.engine.attention.retrieval_heads import HeadCalibration, calibration_path
from cloud.engine.attention.sparse import SparseAttention
from cloud.engine.config import EngineConfig, SparseConfig
from cloud.engine.core import EngineCore
from shared.engine_types import SamplingParams
from shared.errors import InvalidRequestError

BASE = EngineConfig(
    dtype="float32",
    weight_quant="none",
    kv_cache_memory_gib=0.25,
    max_model_len=2048,
    max_num_batched_tokens=384,
    enable_prefix_caching=False,
)
SPARSE = SparseConfig(sinks=16, window=64, budget=192, dense_layers=2, retrieval_heads=None)


@pytest.fixture(scope="module")
def calibration(loaded_model) -> HeadCalibration:  # type: ignore[no-untyped-def]
    return calibrate_heads(loaded_model, BASE, lengths=(1024,), depths=(30, 70))


def test_the_calibration_finds_heads_that_look_at_the_needle(
    calibration: HeadCalibration, loaded_model
) -> None:  # type: ignore[no-untyped-def]
    c = loaded_model.weights.config
    assert (calibration.num_layers, calibration.num_heads, calibration.num_kv_heads) == (
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
    )
    assert calibration.cases >= 1 and calibration.queries >= 1
    mass = torch.tensor(calibration.mass)
    assert bool(((mass >= 0) & (mass <= 1)).all())
    # a few heads put much of their attention on the needle; most put almost none
    dense = calibration.dense_kv_heads(0.1)
    assert float(mass.max()) > 0.3 and 0 < int(dense.sum()) < dense.numel() // 2


def _answer(config: EngineConfig, loaded, ids: list[int]) -> tuple[list[int], torch.Tensor]:  # type: ignore[no-untyped-def]
    core = EngineCore(config, loaded)
    core.add_request("r", ids, SamplingParams(max_tokens=4, temperature=0.0, logprobs=1, prompt_logprobs=0))
    outs = []
    while core.has_work():
        outs += core.step()
    tokens = [t for o in outs for t in o.token_ids]
    return tokens, torch.tensor([r.logprob for r in outs[0].prompt_logprobs[1:]])


def test_every_head_kept_dense_answers_as_the_dense_engine(loaded_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = loaded_model.weights.config
    every = HeadCalibration(
        model="every head",
        num_layers=c.num_layers,
        num_heads=c.num_heads,
        num_kv_heads=c.num_kv_heads,
        cases=1,
        queries=1,
        mass=[[1.0] * c.num_heads] * c.num_layers,
    )
    every.save(tmp_path / "heads.json")
    core = EngineCore(BASE, loaded_model)
    case = make_case(CaseSpec("needle", 1024, 40), Encoder(core.encode_chat, core.tokenizer), 4, seed=0)
    ids = list(case.prompt_ids)
    dense_tokens, dense_lp = _answer(BASE, loaded_model, ids)
    sparse = replace(BASE, attention="sparse", sparse=SPARSE)
    _, sparse_lp = _answer(sparse, loaded_model, ids)
    kept = replace(sparse, sparse=replace(SPARSE, retrieval_heads=str(tmp_path / "heads.json")))
    kept_tokens, kept_lp = _answer(kept, loaded_model, ids)
    assert kept_tokens == dense_tokens
    torch.testing.assert_close(kept_lp, dense_lp, atol=2e-4, rtol=0)
    assert float((sparse_lp - dense_lp).abs().max()) > 10 * float((kept_lp - dense_lp).abs().max())


def test_a_calibration_of_another_model_is_refused_at_start(loaded_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    other = HeadCalibration(
        model="m", num_layers=2, num_heads=4, num_kv_heads=2, cases=1, queries=1, mass=[[0.0] * 4] * 2
    )
    other.save(tmp_path / "heads.json")
    config = replace(
        BASE, attention="sparse", sparse=replace(SPARSE, retrieval_heads=str(tmp_path / "heads.json"))
    )
    with pytest.raises(InvalidRequestError, match="calibrated for 2 layers"):
        EngineCore(config, loaded_model)


def test_sparse_attention_keeps_the_shipped_retrieval_heads_dense_by_default(loaded_model) -> None:  # type: ignore[no-untyped-def]
    shipped = calibration_path("auto", loaded_model.name)
    assert shipped is not None and calibration_path("auto", "a model without one") is None
    assert calibration_path("none", loaded_model.name) is None
    core = EngineCore(replace(BASE, attention="sparse"), loaded_model)  # every sparse option at its default
    attention = core.runner.attention
    sparse = SparseAttention.of(attention)
    assert sparse is not None and sparse.dense_heads is not None
    c = loaded_model.weights.config
    cal = HeadCalibration.load(shipped, c.num_layers, c.num_heads, c.num_kv_heads)
    assert torch.equal(sparse.dense_heads.cpu(), cal.dense_kv_heads(SparseConfig().retrieval_threshold))
    assert 0 < int(sparse.dense_heads.sum()) < sparse.dense_heads.numel() // 3  # a few heads, not most
