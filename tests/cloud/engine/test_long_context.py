"""Long-context options on the real model, each against the dense full-precision engine: sparse
attention with a covering budget is the dense engine bit for bit; a quantized KV cache and a real
sparse budget stay close; memory planning sets the longest context and refuses what cannot fit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cloud.engine.config import EngineConfig, SparseConfig
from cloud.engine.core import EngineCore
from cloud.model.rope import scaled_context
from shared.engine_types import SamplingParams
from shared.errors import ContextLengthExceededError, InvalidRequestError

BASE = EngineConfig(
    dtype="float32",
    weight_quant="none",
    kv_cache_memory_gib=0.25,
    max_model_len=2048,
    max_num_batched_tokens=96,  # several prefill chunks, so later ones read the cached prefix
    enable_prefix_caching=False,
)
STORY = (
    "The lighthouse keeper climbed the stairs every evening, counting the steps as his father had. "
    "Ships passed in the dark and the lamp turned slowly over the water. "
)


def _prompt(core: EngineCore, repeats: int) -> list[int]:
    return core.encode_chat([{"role": "user", "content": STORY * repeats + "What did the keeper count?"}])


def _run(config: EngineConfig, loaded, prompt: list[int] | None = None, repeats: int = 12):  # type: ignore[no-untyped-def]
    core = EngineCore(config, loaded)
    ids = prompt or _prompt(core, repeats)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, prompt_logprobs=0)
    core.add_request("r", ids, params)
    outs = []
    while core.has_work():
        outs += core.step()
    tokens = [t for o in outs for t in o.token_ids]
    prompt_lp = torch.tensor([r.logprob for r in outs[0].prompt_logprobs[1:]])
    sampled_lp = torch.tensor([r.logprob for o in outs for r in (o.logprobs or [])])
    return tokens, prompt_lp, sampled_lp, len(ids)


@pytest.fixture(scope="module")
def dense(loaded_model):  # type: ignore[no-untyped-def]
    return _run(BASE, loaded_model)


def test_sparse_with_a_budget_covering_the_context_is_dense_bit_for_bit(loaded_model, dense) -> None:  # type: ignore[no-untyped-def]
    tokens, prompt_lp, sampled_lp, n = dense
    sparse = SparseConfig(sinks=16, window=32, budget=1024, dense_layers=2)
    assert n + 6 <= sparse.budget
    got = _run(replace(BASE, attention="sparse", sparse=sparse), loaded_model)
    assert got[0] == tokens
    assert torch.equal(got[1], prompt_lp) and torch.equal(got[2], sampled_lp)


def test_sparse_with_a_small_budget_stays_close_to_dense(loaded_model, dense) -> None:  # type: ignore[no-untyped-def]
    tokens, prompt_lp, _, n = dense
    sparse = SparseConfig(sinks=16, window=64, budget=192, dense_layers=2)
    assert n > 2 * sparse.budget  # later prefill chunks and every decode step run sparse
    got = _run(replace(BASE, attention="sparse", sparse=sparse), loaded_model)
    # the first chunks (prefix within the budget) are exact; the rest approximate
    exact = sparse.budget - 1
    assert torch.equal(got[1][:exact], prompt_lp[:exact])
    assert float((got[1] - prompt_lp).abs().mean()) < 0.06  # measured 0.013
    assert got[0][:2] == tokens[:2]


# mean |logprob difference| measured 0.0005 (int8) and 0.009 (int4)
@pytest.mark.parametrize(("kv_dtype", "tolerance"), [("int8", 0.003), ("int4", 0.05)])
def test_quantized_kv_cache_stays_close_to_full_precision(loaded_model, dense, kv_dtype, tolerance) -> None:  # type: ignore[no-untyped-def]
    _, prompt_lp, _, _ = dense
    got = _run(replace(BASE, kv_dtype=kv_dtype), loaded_model)
    # the first chunk attends only to its own fresh keys, unrounded: the same math as the dense run's,
    # summed in another order (the quantized cache's prefill is the PyTorch reference, the dense one
    # the C++ kernel on a CPU), so equal up to fp32 rounding carried through 30 layers
    first_chunk = BASE.max_num_batched_tokens - 1
    torch.testing.assert_close(got[1][:first_chunk], prompt_lp[:first_chunk], rtol=1e-5, atol=1e-4)
    diff = float((got[1] - prompt_lp).abs().mean())
    assert 0 < diff < tolerance


def test_quantized_cache_reports_real_bytes_per_token(loaded_model) -> None:  # type: ignore[no-untyped-def]
    sizes = {
        kv: EngineCore(replace(BASE, kv_dtype=kv), loaded_model).stats().kv_bytes_per_token
        for kv in ("auto", "int8", "int4")
    }
    c = loaded_model.weights.config
    assert sizes["auto"] == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # fp32
    fp16 = sizes["auto"] / 2
    assert sizes["int4"] <= 0.3 * fp16 < sizes["int8"] < fp16


def _core_with_capacity(loaded, tokens: int, **kw) -> EngineCore:  # type: ignore[no-untyped-def]
    c = loaded.weights.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    config = replace(BASE, kv_cache_memory_gib=tokens * per_token / 2**30, max_model_len=None, **kw)
    return EngineCore(config, loaded)


def test_longest_context_follows_from_the_kv_budget(loaded_model) -> None:  # type: ignore[no-untyped-def]
    core = _core_with_capacity(loaded_model, 40 * 16)
    assert core.max_model_len == 640 and core.pool.num_blocks == 40
    assert "longest context 640 tokens" in core.kv_plan.describe()
    with pytest.raises(InvalidRequestError, match="--max-model-len 4096 needs more KV memory"):
        EngineCore(replace(BASE, kv_cache_memory_gib=640 * 46080 / 2**30, max_model_len=4096), loaded_model)


def test_a_prompt_one_token_over_the_limit_is_refused_and_one_at_it_is_served(loaded_model) -> None:  # type: ignore[no-untyped-def]
    core = _core_with_capacity(loaded_model, 40 * 16)
    limit, max_tokens = core.max_model_len, 4
    over = [1] * (limit - max_tokens + 1)
    with pytest.raises(ContextLengthExceededError):
        core.add_request("over", over, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    core.add_request(
        "at",
        [1] * (limit - max_tokens),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    outs = []
    while core.has_work():
        outs += core.step()
    assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == max_tokens
    assert core.pool.num_free == core.pool.num_blocks  # everything handed back


def test_yarn_scaling_extends_the_default_context(loaded_model) -> None:  # type: ignore[no-untyped-def]
    core = _core_with_capacity(loaded_model, 40 * 1024, rope_scaling={"type": "yarn", "factor": 4})
    assert scaled_context(core.model_config) == 4 * loaded_model.weights.config.max_position
    assert core.max_model_len == 4 * loaded_model.weights.config.max_position
    assert core.model.rope.attention_factor > 1  # YaRN's attention factor reaches the tables
