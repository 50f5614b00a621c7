"""Embeddings from the engine (cloud/engine/embedding.py): equal to transformers' final-normed hidden
states pooled the same way, whether inputs run whole, packed together or over several chunks; a
long input takes one budget-sized chunk per pass; local layers see only their window."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.embedding import Embedder, EmbedJob, causal_window_attention
from cloud.engine.serving.async_engine import AsyncEngine

# a 16-token chunk: the batch below packs several inputs into one chunk and splits the longest
CONFIG = EngineConfig(
    dtype="float32",
    weight_quant="none",
    kv_cache_memory_gib=0.1,
    max_model_len=512,
    max_num_batched_tokens=16,
)
TEXTS = [
    "The quick brown fox jumps over the lazy dog, then runs into the forest and hides there.",
    "Hello world",
    "A",
]


@pytest.fixture(scope="module")
def engine(loaded_model) -> Iterator[AsyncEngine]:  # type: ignore[no-untyped-def]
    e = AsyncEngine(EngineCore(CONFIG, loaded_model))
    yield e
    e.shutdown()


def _reference(hf_model, inputs: list[list[int]], pooling: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    rows = []
    with torch.no_grad():
        for ids in inputs:
            h = hf_model.model(torch.tensor([ids])).last_hidden_state[0]  # [tokens, hidden], final-normed
            rows.append(h.mean(0) if pooling == "mean" else h[-1])
    return F.normalize(torch.stack(rows), dim=-1)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_equal_transformers_pooled_final_hidden_states(
    engine: AsyncEngine,
    hf_model,  # type: ignore[no-untyped-def]
    pooling: str,
) -> None:
    tok = engine.core.tokenizer
    batch = [tok.encode(t, add_special=True) for t in TEXTS]
    assert len(batch[0]) > CONFIG.max_num_batched_tokens  # it spans chunks, keeping its keys between
    for inputs in ([batch[0]], batch):
        got = asyncio.run(engine.embed(inputs, pooling, f"e-{pooling}"))  # type: ignore[arg-type]
        want = _reference(hf_model, inputs, pooling)
        assert got.shape == (len(inputs), engine.core.model_config.hidden_size)
        assert (got - want).abs().max().item() < 1e-3
        assert F.cosine_similarity(got, want).min().item() > 0.9999
        assert torch.allclose(got.norm(dim=-1), torch.ones(len(inputs)), atol=1e-5)


def test_a_long_input_takes_one_budget_sized_chunk_per_pass(engine: AsyncEngine) -> None:
    embedder = Embedder(engine.core.model, budget=16, max_jobs=4)
    heard: list[torch.Tensor | BaseException] = []
    embedder.add(EmbedJob("long", [list(range(100, 140))], "mean", heard.append))  # 40 tokens: 3 chunks
    embedder.add(EmbedJob("short", [[5, 6, 7]], "last", heard.append))
    for _ in range(2):
        embedder.run_chunk()
        assert not heard and embedder.has_work()
    embedder.run_chunk()  # the long input's last 8 tokens and the short job share the third chunk
    assert len(heard) == 2 and not embedder.has_work()
    embedder.add(EmbedJob("gone", [[1, 2, 3]], "mean", heard.append))
    assert embedder.abort("gone") and not embedder.has_work() and len(heard) == 2


def test_window_attention_equals_a_masked_softmax() -> None:
    torch.manual_seed(0)
    start, n, window = 5, 4, 3
    q = torch.randn(n, 4, 8)  # [tokens, heads, d]: 4 heads over 2 kv heads
    k, v = torch.randn(start + n, 2, 8), torch.randn(start + n, 2, 8)
    got = causal_window_attention(q, k, v, start, window, 8**-0.5)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    for i in range(n):
        p = start + i
        seen = range(p - window + 1, p + 1)  # the query's own position and the two before it
        s = torch.einsum("hd,thd->ht", q[i], kk[list(seen)]) * 8**-0.5
        want = torch.einsum("ht,thd->hd", s.softmax(-1), vv[list(seen)])
        assert torch.allclose(got[i], want, atol=1e-5)
