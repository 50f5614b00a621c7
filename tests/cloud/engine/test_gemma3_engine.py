"""Gemma 3 270M (Q4_K_M GGUF, the registry's `gemma-3-270m`) in our engine against transformers'
Gemma3ForCausalLM in fp32: the logits of every generated step agree to 1e-3 and greedy tokens are
the same, for a short prompt and for prompts longer than the 512-token window (so the local layers
drop keys), prefilled in chunks, and partly from the prefix cache.

The reference is transformers' modeling code run on the weights our loader dequantized (its GGUF
loader takes minutes on this machine's two cores); the dequantization itself is held equal to the
gguf package's in tests/cloud/model/test_kquants.py. The prompts are token ids drawn from the
vocabulary with a fixed seed, BOS first: what is compared does not depend on a tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from cloud.engine.config import EngineConfig, SparseConfig
from cloud.engine.core import EngineCore
from cloud.model.gguf_loader import _dequantize, read_config
from cloud.model.kquants import KQUANTS
from cloud.model.loading import LoadedModel, load_gguf_model
from cloud.model.registry import GEMMA3_270M
from cloud.model.weights import ModelWeights
from shared.engine_types import SamplingParams

from .recording import RecordingSampler

TOL = 1e-3
BOS = 2
WINDOW = 512
CHUNK = 200  # prefill chunks that end off block edges and off the window's edge
NEW_TOKENS = 8


def reference_model(weights: ModelWeights) -> torch.nn.Module:
    """transformers' Gemma 3 with our loader's weights. The GGUF stores Gemma's norm weights as
    1 + w; transformers keeps w and adds 1 in its forward, so 1 comes off here (as its own GGUF
    loader does)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    c = weights.config
    config = Gemma3TextConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position,
        rms_norm_eps=c.rms_eps,
        query_pre_attn_scalar=c.head_dim,
        sliding_window=WINDOW,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        tie_word_embeddings=True,
        dtype=torch.float32,
    )
    state: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": weights.embed,
        "model.norm.weight": weights.final_norm - 1,
        "lm_head.weight": weights.embed,
    }
    for i, lw in enumerate(weights.layers):
        p = f"model.layers.{i}."
        assert lw.q_norm is not None and lw.k_norm is not None
        assert lw.post_attn_norm is not None and lw.post_ffn_norm is not None
        state |= {
            p + "self_attn.q_proj.weight": lw.wq,
            p + "self_attn.k_proj.weight": lw.wk,
            p + "self_attn.v_proj.weight": lw.wv,
            p + "self_attn.o_proj.weight": lw.wo,
            p + "self_attn.q_norm.weight": lw.q_norm - 1,
            p + "self_attn.k_norm.weight": lw.k_norm - 1,
            p + "input_layernorm.weight": lw.attn_norm - 1,
            p + "post_attention_layernorm.weight": lw.post_attn_norm - 1,
            p + "pre_feedforward_layernorm.weight": lw.ffn_norm - 1,
            p + "post_feedforward_layernorm.weight": lw.post_ffn_norm - 1,
            p + "mlp.gate_proj.weight": lw.w_gate,
            p + "mlp.up_proj.weight": lw.w_up,
            p + "mlp.down_proj.weight": lw.w_down,
        }
    with torch.device("meta"):
        model = Gemma3ForCausalLM(config)
    result = model.load_state_dict(state, strict=False, assign=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    # buffers made on meta: the RoPE tables and the embedding scale
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    model.model.embed_tokens.embed_scale = torch.tensor(c.hidden_size**0.5)
    return model.eval()


@dataclass(slots=True)
class Run:
    prompts: dict[str, list[int]]
    tokens: dict[str, list[int]]
    logits: dict[str, list[torch.Tensor]]
    prefix_hit_tokens: int
    layer_windows: tuple[int | None, ...]
    attention: str
    layout: bool  # whether the engine kept only the local layers' windows


@dataclass(slots=True)
class Reference:
    tokens: list[int]
    logits: list[torch.Tensor]  # [vocab] per generated step


@pytest.fixture(scope="module")
def gemma(gemma_reader: Any, gemma_path: Path) -> LoadedModel:
    # the registry's four part wheels, joined and checked (tests/cloud/model/test_gemma3.py holds
    # that `--model gemma-3-270m` resolves to this file)
    return load_gguf_model(gemma_reader, gemma_path, GEMMA3_270M.name)


def test_real_tensors_decode_as_the_gguf_reference_and_the_config_is_gemmas(gemma_reader: Any) -> None:
    reader = gemma_reader
    import gguf

    smallest: dict[str, Any] = {}
    for t in reader.tensors:
        q = t.tensor_type.name
        if q in KQUANTS and (q not in smallest or t.n_elements < smallest[q].n_elements):
            smallest[q] = t
    assert sorted(smallest) == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    for t in smallest.values():
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        got = _dequantize(t)  # the loader's path: torch decoder, ggml's row order, fp32
        np.testing.assert_array_equal(got.numpy(), want, err_msg=t.name)

    c = read_config(reader)
    assert (c.arch, c.num_layers, c.hidden_size, c.intermediate_size) == ("gemma3", 18, 640, 2048)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 1, 256)  # head_dim from key_length
    assert (c.rope_theta, c.rope_local_theta, c.max_position) == (1e6, 1e4, 32768)
    assert c.layer_windows == tuple(None if (i + 1) % 6 == 0 else WINDOW for i in range(18))


def _engine(gemma: LoadedModel, **changes: Any) -> tuple[EngineCore, RecordingSampler]:
    """An engine over Gemma's float32 weights, recording each step's logits; `changes` to its config."""
    config = EngineConfig(
        dtype="float32", weight_quant="none", kv_cache_memory_gib=0.25, max_num_batched_tokens=256
    )
    core = EngineCore(replace(config, **changes), gemma)
    rec = RecordingSampler()
    core.runner.sampler = rec
    return core, rec


def _drain(core: EngineCore, out: dict[str, list[int]]) -> int:
    """Steps until every request has finished, each request's tokens added to out[its id]; returns
    the pages held after the last step that left a request running."""
    held = 0
    while core.has_work():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
        if core.scheduler.running:
            held = core.pool.num_blocks - core.pool.num_free
    return held


@pytest.fixture(scope="module")
def run(gemma: LoadedModel) -> Run:
    """One engine, three requests: a short prompt and a 530-token one together (batched decode rows
    of different lengths; the long one prefilled in 200-token chunks across the window's edge), then
    the long one's whole conversation continued (a prefix-cache hit past the window)."""
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1000, gemma.weights.config.vocab_size // 2, (n,), generator=g).tolist()

    prompts = {"short": [BOS, *tokens(11)], "long": [BOS, *tokens(529)]}
    core, rec = _engine(gemma, max_model_len=1024, max_num_batched_tokens=CHUNK)
    out: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    core.add_request("short", prompts["short"], params)
    core.add_request("long", prompts["long"], params)
    _drain(core, out)
    prompts["hit"] = prompts["long"] + out["long"] + tokens(23)
    core.add_request("hit", prompts["hit"], params)
    _drain(core, out)
    windows = tuple(core.model.attention_window(i) for i in range(gemma.weights.config.num_layers))
    return Run(
        prompts,
        out,
        rec.logits,
        core.stats().prefix_hit_tokens,
        windows,
        type(core.runner.attention).__name__,
        core.kv_plan.layout is not None,
    )


@pytest.fixture(scope="module")
def reference(gemma: LoadedModel, run: Run) -> dict[str, Reference]:
    """transformers' greedy generation of each prompt with its per-step logits; the continued
    conversation reuses transformers' own cache of the long one (only its new tokens are computed)."""
    hf = reference_model(gemma.weights)
    refs: dict[str, Reference] = {}
    cache = None
    for rid in ("long", "hit", "short"):
        prompt = run.prompts[rid]
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                **({"cache": cache} if rid == "hit" else {}),
            )
        if rid == "long":
            cache = out.cache
            assert cache is not None
        refs[rid] = Reference(out.sequences[0, len(prompt) :].tolist(), [x[0].float() for x in out.logits])
    return refs


def test_the_engine_runs_gemmas_windows(run: Run) -> None:
    assert run.layer_windows == tuple(None if (i + 1) % 6 == 0 else WINDOW for i in range(18))
    assert run.attention == "WindowedAttention"
    assert run.layout  # the local layers kept their windows only: what transformers is held to below
    assert len(run.prompts["long"]) > WINDOW
    assert run.prefix_hit_tokens >= 528  # the long conversation's whole blocks


@pytest.mark.parametrize("rid", ["short", "long", "hit"])
def test_logits_and_greedy_tokens_match_transformers_generate(
    run: Run, reference: dict[str, Reference], rid: str
) -> None:
    ref = reference[rid]
    assert run.tokens[rid] == ref.tokens
    assert len(run.logits[rid]) == NEW_TOKENS
    for step, (got, want) in enumerate(zip(run.logits[rid], ref.logits, strict=True)):
        diff = (got - want).abs().max().item()
        assert diff < TOL, f"{rid} step {step}: max |logit diff| {diff}"


def test_local_layers_keep_only_their_window_and_generate_as_the_plain_layout(gemma: LoadedModel) -> None:
    """A prompt of 2.5 windows, then its conversation continued (a prefix hit whose early blocks'
    local pages are long gone): the per-layer-type layout and the plain one (every layer, every
    token) give the same greedy tokens and logits, while the first holds a fraction of the KV. The
    per-layer-type engine keeps its page map apart from the pool's, as a GPU engine does."""
    g = torch.Generator().manual_seed(1)
    vocab = gemma.weights.config.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(1000, vocab // 2, (n,), generator=g).tolist()

    doc = [BOS, *tokens(1299)]
    extra = tokens(37)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = {}
    for hybrid in (True, False):
        core, rec = _engine(gemma, max_model_len=2048, disable_hybrid_kv_cache_manager=not hybrid)
        assert (core.kv_plan.layout is not None) is hybrid
        if hybrid:  # the cache reads its own copy of the page map, fed changed rows, as on a GPU
            assert core.cache.page_map is core.pool.page_map
            core.cache.page_map = core.pool.page_map.clone()
        out: dict[str, list[int]] = {}
        core.add_request("doc", doc, params)
        held = _drain(core, out)  # pages the document's request holds once decoding
        core.add_request("hit", doc + out["doc"] + extra, params)
        _drain(core, out)
        page_bytes = core.kv_plan.bytes_per_token * core.kv_plan.block_size
        results[hybrid] = (out, rec.logits, held * page_bytes, core.stats().prefix_hit_tokens)
    out, logits, held_bytes, hit = results[True]
    plain_out, plain_logits, plain_bytes, plain_hit = results[False]
    assert out == plain_out
    for rid in ("doc", "hit"):
        for got, want in zip(logits[rid], plain_logits[rid], strict=True):
            assert torch.allclose(got, want, atol=1e-4, rtol=0)
    assert hit == plain_hit >= 1296  # the whole document's blocks, found though its early local pages left
    # 1306 tokens: the plain layout holds 82 blocks of 18 layers; this one 82 pages of the 3 global
    # layers and each local group's window (5 x 34 pages of 3 layers): 0.52 of it
    assert held_bytes <= 0.55 * plain_bytes


def test_sparse_attention_selects_in_the_global_layers_over_either_layout(gemma: LoadedModel) -> None:
    """`--attention sparse` on a model with sliding-window layers: the three global layers choose
    their blocks (Quest, a 160-token budget over a 600-token prompt), the local ones attend to
    their window. The per-layer-type layout (key summaries for the global layers' pages only) gives
    the plain layout's tokens and logits, and the selection changes the logits from dense's."""
    g = torch.Generator().manual_seed(2)
    prompt = [BOS, *torch.randint(1000, gemma.weights.config.vocab_size // 2, (599,), generator=g).tolist()]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    sparse = SparseConfig(sinks=32, window=64, budget=160)
    results = {}
    for name, attention, hybrid in (
        ("layout", "sparse", True),
        ("plain", "sparse", False),
        ("dense", "dense", True),
    ):
        core, rec = _engine(
            gemma,
            max_model_len=1024,
            attention=attention,
            sparse=sparse,
            disable_hybrid_kv_cache_manager=not hybrid,
        )
        assert (core.kv_plan.layout is not None) is hybrid
        out: dict[str, list[int]] = {}
        core.add_request("doc", prompt, params)
        _drain(core, out)
        results[name] = (out["doc"], rec.logits["doc"])
    (out, logits), (plain_out, plain_logits), (_, dense_logits) = results.values()
    assert out == plain_out
    for got, want in zip(logits, plain_logits, strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=0)
    assert (logits[0] - dense_logits[0]).abs().max().item() > 1e-3  # the far blocks were chosen among
