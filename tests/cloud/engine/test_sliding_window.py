"""The sliding_window overflow policy (StreamingLLM): a request longer than the context keeps its
sink blocks and a ring of recent blocks, and attends as if the sinks sat right before the window."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cloud.engine.attention.dense import AttentionMetadata, DenseAttention
from cloud.engine.config import EngineConfig, SparseConfig
from cloud.engine.core import EngineCore
from cloud.engine.kv.block_pool import BlockPool
from cloud.engine.kv.cache import KVCache
from cloud.engine.request import FinishReason, Request
from cloud.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from cloud.model.config import ModelConfig
from cloud.model.rope import RotaryEmbedding
from shared.engine_types import SamplingParams
from shared.errors import ContextLengthExceededError

BS, HEADS, KV_HEADS, DIM = 4, 4, 2, 16


def _rope() -> RotaryEmbedding:
    config = ModelConfig(
        arch="llama",
        num_layers=1,
        hidden_size=HEADS * DIM,
        intermediate_size=8,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=DIM,
        vocab_size=10,
        max_position=64,
        rope_theta=10000.0,
        rms_eps=1e-6,
        tie_embeddings=True,
    )
    return RotaryEmbedding(config, 64, torch.float32)


def _rotate(rope: RotaryEmbedding, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = rope.tables(positions)  # [n, 1, d]
    return rope.apply(x, cos, sin)


def test_shift_composes_rotations_and_tables_run_past_their_end() -> None:
    rope = _rope()
    x = torch.randn(5, KV_HEADS, DIM, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(10, 15)
    torch.testing.assert_close(
        rope.shift(_rotate(rope, x, pos).transpose(0, 1), torch.tensor(7)).transpose(0, 1),
        _rotate(rope, x, pos + 7),
    )
    far = torch.tensor([100, 1000])  # past the 64-position tables: computed, same formula
    cos, _ = rope.tables(far)
    want = torch.cos(far.double()[:, None] * rope.inv_freq).float()
    torch.testing.assert_close(cos[:, 0, : DIM // 2], want)


def test_sliding_decode_sees_the_sinks_at_their_in_cache_distance() -> None:
    """Keys are stored rotated at their true positions. After dropping the middle, the query must
    score the sinks as if they sat right before the window: the same attention as a fresh cache
    holding sinks + window at positions 0..n-1 (StreamingLLM's in-cache positions)."""
    rope = _rope()
    g = torch.Generator().manual_seed(1)
    sinks, dropped, window = 4, 40, 12  # positions 0-3 kept, 4-43 dropped, 44-55 kept
    n = sinks + window
    k0 = torch.randn(n, KV_HEADS, DIM, generator=g)  # unrotated keys of the kept tokens
    v = torch.randn(n, KV_HEADS, DIM, generator=g)
    q0 = torch.randn(1, HEADS, DIM, generator=g)
    true_pos = torch.cat([torch.arange(sinks), torch.arange(sinks + dropped, sinks + dropped + window)])
    cache = KVCache(1, 8, BS, KV_HEADS, DIM, torch.float32)
    slots = torch.arange(n)
    cache.write(0, _rotate(rope, k0, true_pos), v, slots)  # blocks 0 (sinks), 1-3 (window)
    q = _rotate(rope, q0, true_pos[-1:])
    attn = DenseAttention(HEADS, KV_HEADS, DIM, rope)
    meta = AttentionMetadata(
        slots[-1:], 1, torch.arange(4)[None], None, [], torch.tensor([n]), torch.tensor([dropped]), sinks
    )
    got = attn(0, q, k0[:1], v[:1], cache, meta)
    # the reference: a fresh cache at in-cache positions 0..n-1
    fresh = KVCache(1, 8, BS, KV_HEADS, DIM, torch.float32)
    fresh.write(0, _rotate(rope, k0, torch.arange(n)), v, slots)
    plain = AttentionMetadata(slots[-1:], 1, torch.arange(4)[None], None, [], torch.tensor([n]))
    want = attn(0, _rotate(rope, q0, torch.tensor([n - 1])), k0[:1], v[:1], fresh, plain)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # without the shift the sinks sit 40 positions too far: a different answer
    unshifted = AttentionMetadata(slots[-1:], 1, torch.arange(4)[None], None, [], torch.tensor([n]))
    assert not torch.allclose(attn(0, q, k0[:1], v[:1], cache, unshifted), want, atol=1e-3)


def test_a_sliding_request_keeps_its_sinks_and_a_ring_of_recent_blocks() -> None:
    pool = BlockPool(8)
    # context 24 tokens (6 blocks), chunks of 8: between steps a sliding request holds <= 4 blocks
    s = Scheduler(SchedulerConfig(4, 8, 8, 24, sink_blocks=1, ring_blocks=4), pool, 4)
    r = Request("r", list(range(30)), SamplingParams(max_tokens=20))
    r.sliding = True
    s.add(r)
    finish = None
    while finish is None:
        out = s.schedule()
        assert sum(1 for b in r.block_ids if b >= 0) <= 6  # never more than the context
        sampled = {c.request.request_id: [7] for c in out.chunks if c.sample}
        events = s.update(out, sampled)
        finish = events[0].finish if events else None
        if finish is not None:
            break
        live = [i for i, b in enumerate(r.block_ids) if b >= 0]
        assert len(live) <= 4 and live[0] == 0  # the sink block stays
        assert live[1:] == list(range(live[1], live[1] + len(live) - 1))  # then consecutive recent blocks
    assert finish is FinishReason.LENGTH and len(r.output_token_ids) == 20  # ran past the 24-token context
    assert r.num_tokens == 50 and pool.num_free == 8  # everything handed back


def test_the_real_model_counts_on_past_its_context_with_a_sliding_window(loaded_model) -> None:  # type: ignore[no-untyped-def]
    config = EngineConfig(
        dtype="float32",
        weight_quant="none",
        kv_cache_memory_gib=0.05,
        max_model_len=256,
        max_num_batched_tokens=64,
        sparse=SparseConfig(sinks=16),
        context_overflow="sliding_window",
    )
    core = EngineCore(config, loaded_model)
    prompt = core.tokenizer.encode(", ".join(str(i) for i in range(1, 161)) + ",", add_special=False)
    assert len(prompt) > 2 * core.max_model_len
    core.add_request("count", prompt, SamplingParams(max_tokens=30, temperature=0.0))
    text, held = "", 0
    while core.has_work():
        text += "".join(o.text for o in core.step())
        held = max(held, core.pool.num_blocks - core.pool.num_free)
    assert held <= core.max_model_len // 16  # never more KV than one context
    assert text.startswith(" 161, 162, 163, 164"), text
    with pytest.raises(ContextLengthExceededError):  # the default policy refuses the same request
        EngineCore(replace(config, context_overflow="error"), loaded_model).add_request(
            "x", prompt, SamplingParams(max_tokens=30)
        )
