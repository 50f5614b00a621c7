"""Engine configuration: one home for every engine option, with defaults for a first-time user."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from cloud.model.linear import WeightQuant

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # a .gguf file or a Hugging Face directory; None: the default model
    served_model_name: str | None = None
    dtype: DType = "auto"  # activations, KV cache and norms; auto: float32
    weight_quant: WeightQuant = "auto"  # auto: the fastest kernels on this machine, timed at start
    block_size: int = 16
    kv_cache_memory_gib: float = 2.0  # KV budget; the number of blocks follows from it
    max_model_len: int | None = None  # default: the model's trained context, capped by the KV budget
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_waiting: int = 256
    enable_prefix_caching: bool = True
    seed: int = 0  # for requests without a seed: makes a whole run reproducible

    @property
    def run_dtype(self) -> str:
        return "float32" if self.dtype == "auto" else self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.run_dtype]
