"""The engine with its attention kernels against the engine's PyTorch attention, the reference: same
logits at every step, same greedy tokens. The Triton kernels (the GPU path; run by the interpreter
on a CPU) and the compiled C++ CPU kernels. Covers a fresh prefill, chunked prefill after a cached
prefix, a prefix-cache hit, batched decode, the int8 / int4 / fp8 KV caches and sparse attention.
Kept to a few short steps: the interpreter is slow."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from cloud.engine.config import EngineConfig, SparseConfig
from cloud.engine.core import EngineCore
from cloud.engine.sampling.sampler import Sampler, SamplingBatch
from kernels.cpu.paged_attention import available as cpu_kernels_available
from shared.engine_types import SampleResult, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BASE = EngineConfig(
    device=DEVICE,
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
TOLERANCE = {"auto": 2e-3, "int8": 2e-3, "int4": 2e-3, "fp8": 0.15}
# a budget of 3 blocks of 8 (one sink, one window, one chosen) is exceeded by every decode row; every
# head sparse, and then with the model's shipped retrieval heads attending to every block
SPARSE = {
    "attention": "sparse",
    "sparse": SparseConfig(sinks=8, window=8, budget=24, dense_layers=2, retrieval_heads=None),
    "block_size": 8,
}
DUO = {**SPARSE, "sparse": SparseConfig(sinks=8, window=8, budget=24, dense_layers=2)}


CASES = [
    ("triton", "auto", {}),
    ("triton", "int8", {}),
    ("triton", "fp8", {}),
    ("triton", "auto", SPARSE),
    ("triton", "auto", DUO),
    ("cpu", "auto", {}),
    ("cpu", "int8", {}),
    ("cpu", "int4", {}),
    ("cpu", "auto", SPARSE),
    ("cpu", "auto", DUO),
    ("cpu", "int4", SPARSE),
    ("cpu", "int8", DUO),
]


@pytest.mark.parametrize(
    "kernels, kv_dtype, overrides",
    CASES,
    ids=[f"{k}-{d}" + ((f"-{'duo' if o is DUO else 'sparse'}") if o else "") for k, d, o in CASES],
)
def test_kernels_give_the_reference_logits_in_the_engine(
    loaded_model, kernels: str, kv_dtype: str, overrides
) -> None:  # type: ignore[no-untyped-def]
    if kernels == "cpu" and (DEVICE != "cpu" or not cpu_kernels_available()):
        pytest.skip("the C++ kernels serve a CPU where they could be built")
    if kernels == "triton" and DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton needs a GPU or the interpreter")
    ref_tokens, ref_logits = _run(loaded_model, "torch", kv_dtype=kv_dtype, **overrides)
    got_tokens, got_logits = _run(loaded_model, kernels, kv_dtype=kv_dtype, **overrides)
    assert got_tokens == ref_tokens
    assert len(got_logits) == len(ref_logits)
    for a, b in zip(got_logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, atol=TOLERANCE[kv_dtype], rtol=1e-3)
