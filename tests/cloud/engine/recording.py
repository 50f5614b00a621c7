"""The real sampler, keeping every logits row it is given: engine tests compare them to a reference."""

from __future__ import annotations

import torch

from cloud.engine.config import EngineConfig, KVDType, SparseConfig
from cloud.engine.core import EngineCore
from cloud.engine.sampling.sampler import Sampler, SamplingBatch
from cloud.model.loading import LoadedModel
from shared.engine_types import SampleResult


class RecordingSampler(Sampler):
    """The real sampler, recording the logits row it was given for each request at each step."""

    def __init__(self) -> None:
        super().__init__()
        self.logits: dict[str, list[torch.Tensor]] = {}

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[SampleResult]:
        for row, req in enumerate(batch.rows):
            self.logits.setdefault(req.request_id, []).append(logits[row].clone())
        return super().__call__(logits, batch)


def recorded_sparse_core(
    loaded_model: LoadedModel,
    kernels: str,
    sparse: SparseConfig,
    block_size: int,
    kv_dtype: KVDType = "auto",
    max_num_seqs: int = 1,
) -> tuple[EngineCore, RecordingSampler]:
    """A small float32 CPU engine with sparse attention through `kernels` (torch: the reference), its
    sampler recording every logits row."""
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        weight_quant="none",
        kv_cache_memory_gib=0.1,
        max_num_seqs=max_num_seqs,
        max_model_len=256,
        block_size=block_size,
        kv_dtype=kv_dtype,
        attention="sparse",
        attention_kernels=kernels,
        sparse=sparse,
    )
    core = EngineCore(config, loaded_model)
    rec = core.runner.sampler = RecordingSampler()
    return core, rec
