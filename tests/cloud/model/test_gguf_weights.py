"""The model on the GGUF file's own blocks (--weight-quant gguf): the blocks the loader keeps are the
file's, in the same row order as the dequantized weights, and the engine on them computes the float32
reference's logits (fp32 activations and accumulation; only the summation order differs)."""

from __future__ import annotations

import pytest
import torch

from cloud.engine.config import EngineConfig
from cloud.engine.core import EngineCore
from cloud.engine.sampling.sampler import Sampler, SamplingBatch
from cloud.model.linear import Kernel, WeightPlan, plan_weights
from kernels.cpu.gguf_matmul import available, dequantize_reference
from shared.engine_types import SampleResult, SamplingParams

pytestmark = pytest.mark.skipif(not available(), reason="the C++ GGUF kernels could not be built here")


def test_the_kept_blocks_are_the_dequantized_weights(loaded_model) -> None:  # type: ignore[no-untyped-def]
    w = loaded_model.weights
    for layer in (w.layers[0], w.layers[-1]):
        assert set(layer.blocks) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
        for name, blocks in layer.blocks.items():
            # Q and K rows come un-permuted (llama.cpp's interleaved RoPE order undone) like the floats
            assert torch.equal(dequantize_reference(blocks), getattr(layer, name)), name
    assert w.lm_head_blocks is not None and torch.equal(dequantize_reference(w.lm_head_blocks), w.lm_head)


def test_a_weight_without_blocks_falls_back_to_float32() -> None:
    k = Kernel(torch.randn(8, 32), "gguf", torch.float32)
    assert k.kind == "float32" and k.blocks is None


def test_gguf_is_an_auto_candidate_only_for_a_quantized_file() -> None:
    assert plan_weights("float32", "gguf", (64, 64), 2) == WeightPlan.single("gguf")
    plain = plan_weights("float32", "auto", (64, 64), 2)
    assert "gguf" not in (plain.small, plain.large)


class _Recorder(Sampler):
    def __init__(self) -> None:
        super().__init__()
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampleResult]:
        self.logits.append(logits.clone())
        return super().__call__(logits, batch)


def _generate(loaded_model, weight_quant: str) -> tuple[dict[str, list[int]], list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    config = EngineConfig(device="cpu", dtype="float32", weight_quant=weight_quant, kv_cache_memory_gib=0.1)
    core = EngineCore(config, loaded_model)
    rec = _Recorder()
    core.runner.sampler = rec
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers."]
    for i, text in enumerate(prompts):
        ids = core.encode_chat([{"role": "user", "content": text}])
        core.add_request(f"p{i}", ids, SamplingParams(max_tokens=24, temperature=0.0))
    out: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out, rec.logits


def test_the_engine_on_the_files_blocks_gives_the_float32_reference(loaded_model) -> None:  # type: ignore[no-untyped-def]
    ref_tokens, ref_logits = _generate(loaded_model, "none")
    tokens, logits = _generate(loaded_model, "gguf")
    assert tokens == ref_tokens  # greedy agreement: the same weights, the same math
    first = (logits[0] - ref_logits[0]).abs().max()
    assert first < 1e-3, f"first-step logits differ by {first}"


def test_a_tied_head_on_blocks_serves_the_embedding_without_the_float_table(loaded_model) -> None:  # type: ignore[no-untyped-def]
    from cloud.model.llama import LlamaModel

    w = loaded_model.weights
    on_blocks = LlamaModel(w, max_positions=64, plan=WeightPlan.single("gguf"))
    on_floats = LlamaModel(w, max_positions=64, plan=WeightPlan.single("float32"))
    assert on_blocks.embed_blocks is not None and on_blocks.embed.numel() == 0
    assert on_floats.embed_blocks is None
    ids = torch.tensor([0, 5, w.config.vocab_size - 1, 300, 5])
    assert torch.equal(on_blocks._embed(ids), w.embed[ids])  # the float table's exact rows
