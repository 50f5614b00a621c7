"""The engine with its Triton attention kernels (run by the interpreter on this CPU) against the
engine's PyTorch attention, the reference: same logits at every step, same greedy tokens. Covers a
fresh prefill, chunked prefill after a cached prefix, a prefix-cache hit, batched decode, and the
int8 / fp8 KV caches. Kept to a few short steps: the interpreter is slow."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cloud.engine.config import EngineConfig, SparseConfig
from cloud.engine.core import EngineCore
from cloud.engine.request import SamplingParams
from cloud.engine.sampler import Sampler, SampleResult, SamplingBatch

BASE = EngineConfig(
    device="cpu",
    dtype="float32",
    weight_quant="none",
    kv_cache_memory_gib=0.1,
    max_num_seqs=4,
    max_model_len=512,
    max_num_batched_tokens=24,  # a 40-token prompt prefills in two chunks: the second after a prefix
    long_prefill_tokens=0,
)


class _Recorder(Sampler):
    def __init__(self) -> None:
        super().__init__()
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampleResult]:
        self.logits.append(logits.clone())
        return super().__call__(logits, batch)


def _run(loaded_model, kernels: str, **overrides) -> tuple[dict[str, list[int]], list[torch.Tensor]]:  # type: ignore[no-untyped-def]
    core = EngineCore(replace(BASE, attention_kernels=kernels, **overrides), loaded_model)
    rec = _Recorder()
    core.runner.sampler = rec
    doc = core.tokenizer.encode("The Rhine begins in the Swiss Alps and flows to the North Sea. " * 3)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    core.add_request("first", doc[:40], params)
    tokens: dict[str, list[int]] = {}
    added = False
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.token_ids)
        if not added and "first" in tokens:  # its prompt blocks are cached now: the second hits them
            core.add_request("second", doc[:36] + doc[:5], params)
            added = True
    return tokens, rec.logits


# fp8 keeps 3 mantissa bits: a last-bit difference between two exact attention sums can move a
# later layer's key to the neighbouring fp8 value, so its logits agree less closely (seen: 0.034)
TOLERANCE = {"auto": 2e-3, "int8": 2e-3, "fp8": 0.15}
# a budget of 3 blocks of 8 (one sink, one window, one chosen) is exceeded by every decode row
SPARSE = {
    "attention": "sparse",
    "sparse": SparseConfig(sinks=8, window=8, budget=24, dense_layers=2),
    "block_size": 8,
}


@pytest.mark.parametrize(
    "kv_dtype, overrides",
    [("auto", {}), ("int8", {}), ("fp8", {}), ("auto", SPARSE)],
    ids=["dense", "int8", "fp8", "sparse"],
)
def test_triton_kernels_give_the_reference_logits_in_the_engine(
    loaded_model, kv_dtype: str, overrides
) -> None:  # type: ignore[no-untyped-def]
    ref_tokens, ref_logits = _run(loaded_model, "torch", kv_dtype=kv_dtype, **overrides)
    tri_tokens, tri_logits = _run(loaded_model, "triton", kv_dtype=kv_dtype, **overrides)
    assert tri_tokens == ref_tokens
    assert len(tri_logits) == len(ref_logits)
    for a, b in zip(tri_logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, atol=TOLERANCE[kv_dtype], rtol=1e-3)
