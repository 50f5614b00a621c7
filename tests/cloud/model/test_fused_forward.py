"""The model's fused forward (residual + RMSNorm, in-place RoPE: C++ on a CPU, Triton on a GPU)
against its PyTorch forward, the reference, on the default model."""

from __future__ import annotations

import torch

from cloud.engine.runner.profile import _SelfAttention
from cloud.model.llama import LlamaModel
from kernels.cpu import norm_rope


def test_fused_norm_and_rope_give_the_reference_logits(loaded_model) -> None:  # type: ignore[no-untyped-def]
    weights = loaded_model.weights
    c = weights.config
    plain = LlamaModel(weights, max_positions=64, fused_kernels=False)
    fused = LlamaModel(weights, max_positions=64, fused_kernels=True)
    ids = torch.tensor(loaded_model.tokenizer.encode("The capital of France is"))
    positions = torch.arange(ids.shape[0])
    rows = torch.arange(ids.shape[0])  # every position's next-token logits
    attention = _SelfAttention(c.num_heads // c.num_kv_heads, c.head_dim**-0.5)
    expected = plain.forward(ids, positions, attention, rows)
    got = fused.forward(ids, positions, attention, rows)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_a_cpu_model_in_float32_runs_the_fused_path_when_the_kernels_build(loaded_model) -> None:  # type: ignore[no-untyped-def]
    model = LlamaModel(loaded_model.weights, max_positions=64)
    assert model.fused == norm_rope.available()
    assert not LlamaModel(loaded_model.weights, max_positions=64, dtype=torch.bfloat16).fused
