"""Memory planning: how many KV blocks the budget holds and the longest context that follows.

The budget is `--kv-cache-memory` when given, else 90% of the free memory of a GPU (measured after
the weights are loaded), else 2 GiB on CPU. Bytes per token are the real figure of the chosen
layout: codes plus fp16 scales and zero points for a quantized cache, plus key summaries when
sparse attention keeps them. A quantized cache also sets aside its full-precision staging (one
partly filled block per running request) before counting blocks.

The longest admissible context is the smaller of the model's context (scaled by RoPE scaling, or
`--max-model-len`) and what the blocks hold, so one request alone always fits: no request, however
long, can run the engine out of KV memory; longer ones are refused up front.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cloud.model.config import ModelConfig
from shared.errors import InvalidRequestError

from .config import CPU_KV_CACHE_GIB, EngineConfig
from .kv_cache import KVCache
from .kv_quant import BITS
from .quantized_kv_cache import QuantizedKVCache

GPU_MEMORY_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class KVPlan:
    kv_dtype: str  # "float32" / "bfloat16" / "float16" / "int8" / "int4"
    block_size: int
    bytes_per_token: float  # codes, scales, zero points and summaries included
    budget_bytes: int
    budget_source: str
    staging_bytes: int  # full-precision staging of a quantized cache
    num_blocks: int
    max_model_len: int
    track_summaries: bool

    def describe(self) -> str:
        gib = self.budget_bytes / 2**30
        return (
            f"KV cache: {self.kv_dtype}, {self.bytes_per_token:.0f} bytes/token, {self.num_blocks} blocks of "
            f"{self.block_size} ({self.num_blocks * self.block_size} tokens) in {gib:.2f} GiB "
            f"({self.budget_source}); longest context {self.max_model_len} tokens"
        )


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> tuple[int, str]:
    if config.kv_cache_memory_gib is not None:
        return int(config.kv_cache_memory_gib * 2**30), "--kv-cache-memory"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_MEMORY_SHARE), f"{GPU_MEMORY_SHARE:.0%} of free GPU memory"
    return int(CPU_KV_CACHE_GIB * 2**30), "CPU default"


def plan_kv(
    config: EngineConfig, model: ModelConfig, model_context: int, device: torch.device | None = None
) -> KVPlan:
    """model_context: the model's own context after RoPE scaling."""
    device = device or torch.device("cpu")
    bs = config.kv_block_size
    if bs < 1:
        raise InvalidRequestError("--block-size must be at least 1")
    layers, kvh, d = model.num_layers, model.num_kv_heads, model.head_dim
    summaries = config.attention == "sparse"
    budget, source = kv_budget_bytes(config, device)
    staging = 0
    if config.kv_dtype == "auto":
        name = config.run_dtype
        bpt = KVCache.bytes_per_token(layers, kvh, d, config.torch_dtype, bs, summaries)
    else:
        name = config.kv_dtype
        bpt = QuantizedKVCache.bytes_per_token(layers, kvh, d, BITS[name], bs)
        summaries = True  # the key scales are the summaries
        elem = torch.empty((), dtype=config.torch_dtype).element_size()
        staging = (config.max_num_seqs + 1) * 2 * layers * kvh * bs * d * elem
    num_blocks = int((budget - staging) // (bpt * bs))
    if num_blocks < 1:
        raise InvalidRequestError(
            f"the KV budget of {budget / 2**30:.3g} GiB ({source}) holds no {bs}-token block "
            f"at {bpt:.0f} bytes per token"
        )
    capacity = num_blocks * bs
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise InvalidRequestError(
            f"--max-model-len {config.max_model_len} needs more KV memory than the budget holds "
            f"({capacity} tokens in {budget / 2**30:.3g} GiB at {bpt:.0f} bytes per token); "
            "raise --kv-cache-memory or lower --max-model-len"
        )
    max_len = min(config.max_model_len or model_context, capacity)
    return KVPlan(name, bs, bpt, budget, source, staging, num_blocks, max_len, summaries)


def make_kv_cache(
    plan: KVPlan, model: ModelConfig, dtype: torch.dtype, is_free: Callable[[int], bool], max_num_seqs: int
) -> KVCache | QuantizedKVCache:
    shape = (model.num_layers, plan.num_blocks, plan.block_size, model.num_kv_heads, model.head_dim)
    if plan.kv_dtype in BITS:
        return QuantizedKVCache(*shape, dtype, BITS[plan.kv_dtype], is_free, staging_slots=max_num_seqs + 1)
    return KVCache(*shape, dtype, track_summaries=plan.track_summaries)
