"""Memory planning: how many KV blocks the budget holds and the longest context that follows.

The budget is `--kv-cache-memory` when given, else 2 GiB on CPU. On a GPU it is planned as vLLM's
profile run does: the engine loads the weights, runs one forward of the largest step it will ever
schedule (`--max-num-batched-tokens` tokens) and reads the peak memory it took; the KV cache gets
what is left of `--gpu-memory-utilization` (0.9) of the card once the memory in use (weights, other
processes, the CUDA context) and that activation peak are set aside.

Bytes per token are the real figure of the chosen layout: codes plus fp16 scales and zero points
for a quantized cache, plus key summaries when sparse attention keeps them. A quantized cache also
sets aside its full-precision staging (one partly filled block per running request) before
counting blocks.

The longest admissible context is the smaller of the model's context (scaled by RoPE scaling, or
`--max-model-len`) and what the blocks hold, so one request alone always fits: no request, however
long, can run the engine out of KV memory; longer ones are refused up front.

A model with sliding-window layers gets the per-layer-type layout (kv/layout.py) unless it is turned
off (`--disable-hybrid-kv-cache-manager`) or the cache moves whole blocks (quantized caches, KV tiers,
pruning): then a block is a page of the global layers, and what one request holds at its peak is its
blocks plus each local group's window and chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cloud.engine.config import CPU_KV_CACHE_GIB, EngineConfig
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.fp8_cache import Fp8KVCache
from cloud.engine.kv.layout import PageLayout, blocks_for_context, page_layout
from cloud.engine.kv.quant import BITS
from cloud.engine.kv.quantized_cache import QuantizedKVCache
from cloud.model.config import ModelConfig
from shared.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class KVPlan:
    kv_dtype: str  # "float32" / "bfloat16" / "float16" / "int8" / "int4" / "fp8"
    block_size: int
    bytes_per_token: float  # codes, scales, zero points and summaries included
    budget_bytes: int
    budget_source: str
    staging_bytes: int  # full-precision staging of a quantized cache
    num_blocks: int
    max_model_len: int
    track_summaries: bool
    layout: PageLayout | None = None  # per layer type (bytes_per_token is then a page's: global layers)
    summary_parts: int = 1  # key summaries per block (sparse attention's score_block)

    def describe(self) -> str:
        gib = self.budget_bytes / 2**30
        layout = f"; {self.layout.describe()}" if self.layout is not None else ""
        return (
            f"KV cache: {self.kv_dtype}, {self.bytes_per_token:.0f} bytes/token, {self.num_blocks} blocks of "
            f"{self.block_size} ({self.num_blocks * self.block_size} tokens) in {gib:.2f} GiB "
            f"({self.budget_source}){layout}; longest context {self.max_model_len} tokens"
        )


def layout_for(config: EngineConfig, model: ModelConfig) -> PageLayout | None:
    """The per-layer-type layout, where the model has local layers and nothing asks for whole blocks."""
    whole_blocks = (
        config.disable_hybrid_kv_cache_manager
        or config.kv_dtype in BITS
        or config.kv_prune_budget is not None
        or config.kv_host_memory_gib > 0
        or config.kv_offload_dir is not None
        or config.context_overflow == "sliding_window"
    )
    if whole_blocks:
        return None
    return page_layout([model.attention_window(i) for i in range(model.num_layers)])


@dataclass(frozen=True, slots=True)
class GPUMemory:
    """What the profile run saw on the GPU, in bytes."""

    free: int  # free on the card after the weights were loaded and the profile run freed its tensors
    total: int
    activation_peak: int  # the largest step's peak above what was allocated before it


def gpu_kv_budget(mem: GPUMemory, utilization: float) -> int:
    """The KV cache's share: utilization * total, less what is in use and the activation peak."""
    in_use = mem.total - mem.free
    return int(utilization * mem.total) - in_use - mem.activation_peak


def kv_budget_bytes(
    config: EngineConfig, device: torch.device, gpu: GPUMemory | None = None
) -> tuple[int, str]:
    if config.kv_cache_memory_gib is not None:
        return int(config.kv_cache_memory_gib * 2**30), "--kv-cache-memory"
    if device.type == "cuda":
        if gpu is None:
            raise ValueError("planning KV memory on a GPU needs the profile run's figures")
        u = config.gpu_memory_utilization
        budget = gpu_kv_budget(gpu, u)
        if budget <= 0:
            raise InvalidRequestError(
                f"--gpu-memory-utilization {u} leaves no room for the KV cache: {gpu.total / 2**30:.1f} GiB "
                f"card, {(gpu.total - gpu.free) / 2**30:.2f} GiB in use, "
                f"{gpu.activation_peak / 2**30:.2f} GiB of activations at the largest step; "
                "raise it or lower --max-num-batched-tokens"
            )
        return (
            budget,
            f"{u:.0%} of the GPU less weights and a {gpu.activation_peak / 2**20:.0f} MiB activation peak",
        )
    return int(CPU_KV_CACHE_GIB * 2**30), "CPU default"


def plan_kv(
    config: EngineConfig,
    model: ModelConfig,
    model_context: int,
    device: torch.device | None = None,
    gpu: GPUMemory | None = None,
) -> KVPlan:
    """model_context: the model's own context after RoPE scaling; gpu: the profile run's figures."""
    device = device or torch.device("cpu")
    bs = config.kv_block_size
    if bs < 1:
        raise InvalidRequestError("--block-size must be at least 1")
    layout = layout_for(config, model)
    layers, kvh, d = model.num_layers, model.num_kv_heads, model.head_dim
    if layout is not None:
        layers = layout.num_slots  # a page holds the global layers' tokens
    summaries = config.attention == "sparse"
    parts = summary_parts(config, bs) if summaries else 1
    budget, source = kv_budget_bytes(config, device, gpu)
    staging = 0
    if config.kv_dtype == "auto":
        name = config.run_dtype
        bpt = KVCache.bytes_per_token(layers, kvh, d, config.torch_dtype, bs, summaries, parts)
    elif config.kv_dtype == "fp8":
        name = "fp8"
        bpt = Fp8KVCache.bytes_per_token(layers, kvh, d, config.torch_dtype, bs, summaries, parts)
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
    if layout is not None:  # what one request holds at its peak: its blocks and its windows' pages
        reserve = layout.num_groups * layout.window_blocks(config.max_num_batched_tokens, bs)
        capacity = max(num_blocks - reserve, num_blocks // (1 + layout.num_groups)) * bs
        assert blocks_for_context(layout, capacity, config.max_num_batched_tokens, bs) <= num_blocks
    if config.max_model_len is not None and config.max_model_len > capacity:
        raise InvalidRequestError(
            f"--max-model-len {config.max_model_len} needs more KV memory than the budget holds "
            f"({capacity} tokens in {budget / 2**30:.3g} GiB at {bpt:.0f} bytes per token); "
            "raise --kv-cache-memory or lower --max-model-len"
        )
    max_len = min(config.max_model_len or model_context, capacity)
    return KVPlan(name, bs, bpt, budget, source, staging, num_blocks, max_len, summaries, layout, parts)


def summary_parts(config: EngineConfig, block_size: int) -> int:
    """Key summaries per block for sparse attention's `score_block` (1: one per block), or why not."""
    tokens = config.sparse.score_block
    if tokens is None or tokens == block_size:
        return 1
    if tokens < 1 or block_size % tokens:
        raise InvalidRequestError(
            f"--sparse-score-block {tokens} must divide the {block_size}-token KV block (e.g. "
            f"{block_size // 2} or {block_size // 4})"
        )
    if config.kv_dtype in BITS:
        raise InvalidRequestError(
            f"--sparse-score-block {tokens} needs a full-precision or fp8 KV cache: an {config.kv_dtype} "
            "cache's per-block key scales are its summaries"
        )
    return block_size // tokens


def make_kv_cache(
    plan: KVPlan,
    model: ModelConfig,
    dtype: torch.dtype,
    is_free: Callable[[int], bool],
    max_num_seqs: int,
    device: torch.device | None = None,
    spare_blocks: int = 0,
    page_map: torch.Tensor | None = None,
) -> KVCache | QuantizedKVCache:
    """spare_blocks: blocks past the pool's (CUDA graphs write their padding rows there); page_map:
    the block pool's, for a per-layer-type layout."""
    device = device or torch.device("cpu")
    blocks = plan.num_blocks + spare_blocks
    shape = (model.num_layers, blocks, plan.block_size, model.num_kv_heads, model.head_dim)
    layout = plan.layout
    if plan.kv_dtype in BITS:
        bits = BITS[plan.kv_dtype]
        return QuantizedKVCache(*shape, dtype, bits, is_free, staging_slots=max_num_seqs + 1, device=device)
    kind = Fp8KVCache if plan.kv_dtype == "fp8" else KVCache
    return kind(
        *shape,
        dtype,
        track_summaries=plan.track_summaries,
        device=device,
        layout=layout,
        page_map=page_map,
        summary_parts=plan.summary_parts,
    )


def release_free_heap() -> None:
    """Hand memory the process freed back to the OS (glibc keeps freed heap pages, and its dynamic
    mmap threshold moves large buffers onto the heap after the first is freed). The engine calls it
    once the float copies of the weights it does not run on are gone (~600 MiB of the default
    model's resident memory would otherwise stay) and when it goes idle. A no-op off glibc.
    (Pinning the mmap threshold at 1 MiB instead kept the peak ~100 MiB lower but halved decode
    throughput at 32 streams on this VM: a page fault per 4 KiB of every new logits buffer.)"""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


_LIBC: list[Any] = []


def _glibc() -> Any:
    if not _LIBC:
        lib = None
        try:
            import ctypes

            lib = ctypes.CDLL("libc.so.6")
            lib.malloc_trim  # noqa: B018 (must exist: glibc)
        except (OSError, AttributeError):  # not glibc
            lib = None
        _LIBC.append(lib)
    return _LIBC[0]
