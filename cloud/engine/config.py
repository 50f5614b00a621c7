"""Engine configuration: one home for every engine option, with defaults for a first-time user."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cloud.model.formats import WeightQuant

if TYPE_CHECKING:  # torch loads only in the process that runs the engine: a router never needs it
    import torch

DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")  # torch.<name>
AttentionKind = Literal["dense", "sparse"]
KVDType = Literal["auto", "int8", "int4", "fp8"]
KV_DTYPES: tuple[KVDType, ...] = ("auto", "int8", "int4", "fp8")
AttentionKernels = Literal["auto", "torch", "triton", "cpu"]
ATTENTION_KERNELS: tuple[AttentionKernels, ...] = ("auto", "torch", "triton", "cpu")
OffloadDType = Literal["auto", "int8", "int4"]
Speculative = Literal["off", "ngram"]
SPECULATIVE: tuple[Speculative, ...] = ("off", "ngram")
ContextOverflow = Literal["error", "truncate_middle", "sliding_window", "drop_old_turns"]
CONTEXT_OVERFLOWS: tuple[ContextOverflow, ...] = (
    "error",
    "truncate_middle",
    "sliding_window",
    "drop_old_turns",
)
CPU_KV_CACHE_GIB = 2.0  # the KV budget on CPU when none is given (on a GPU: a share of free memory)
GPU_MEMORY_UTILIZATION = 0.9  # the share of a GPU's memory the engine may take (vLLM's default)


DENSE_LAYERS = 2  # the first layers a sparse engine keeps dense when no retrieval heads are


@dataclass(frozen=True, slots=True)
class SparseConfig:
    """Block-sparse attention (Quest-style): sinks + recent window + top-k blocks by key bounds."""

    sinks: int = 64  # the first tokens, always attended (attention sinks)
    window: int = 256  # the most recent tokens, always attended
    budget: int = 2048  # tokens attended per query in all (sinks and window included)
    # the first layers stay dense; None: none where retrieval heads are dense (they keep what the first
    # layers' wide attention needs: as accurate, a fifth less read at 16K), else 2
    dense_layers: int | None = None
    top_p: float | None = None  # keep the fewest selected blocks whose estimated mass reaches p
    # how a KV head's blocks are ranked: "group", by the best bound over its query heads; "head", by
    # each query head's own bound order (a block's best place in any of them): a head whose bounds
    # run low is not outvoted by its group's
    select: Literal["group", "head"] = "group"
    # a head calibration (retrieval_heads.py): KV heads with a query head whose mean needle mass is at
    # least retrieval_threshold attend densely, the rest sparsely. "auto": the calibration shipped for
    # the served model where there is one (cloud/model/heads/); None: every head sparse
    retrieval_heads: str | None = "auto"
    # 0.2: SmolLM2's 11 heads (of 90) rather than 0.1's 18, as accurate up to 16K with 3/4 of the decode
    # attention (docs/benchmarks.md, "Usable context")
    retrieval_threshold: float = 0.2
    # a decode step chooses its blocks afresh only every `reselect` tokens (and whenever a row opens a
    # block or the batch changes); in between each layer takes its last selection (reselect.py). 4: as
    # accurate as every token up to 16K, a tenth less decode attention there (docs/benchmarks.md)
    reselect: int = 4
    # tokens a key summary covers when scoring blocks: None, a whole block; fewer (a divisor of the
    # block size, full-precision caches only) bounds each block by its best part, a tighter bound for
    # the same blocks read (the summaries take block_size / score_block times the memory)
    score_block: int | None = None


LONG_PREFILL_TOKENS = 256  # the default cap; 12x faster first tokens for short prompts behind a long one


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # a .gguf file or a Hugging Face directory; None: the default model
    served_model_name: str | None = None
    device: str = "auto"  # auto (a CUDA GPU when torch sees one, else the CPU), cpu, cuda, cuda:N
    dtype: DType = "auto"  # activations, KV cache and norms; auto: bfloat16 on a GPU, float32 on a CPU
    weight_quant: WeightQuant = "auto"  # auto: the fastest kernels on this machine, timed at start
    block_size: int | None = None  # None: 16, or 32 for a quantized KV cache (its key scales are per block)
    kv_cache_memory_gib: float | None = None  # KV budget; None: 2 GiB on CPU, planned on a GPU
    # a GPU's share the engine takes: weights, the profiled peak activations and the KV cache
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    max_model_len: int | None = None  # default: the model's (scaled) context, capped by the KV budget
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    # a prefill's share of a step while others wait or run (0: no cap): short prompts start and
    # running requests decode alongside a long prefill (ctxfuse bench prefill-cap, docs/benchmarks.md)
    long_prefill_tokens: int = LONG_PREFILL_TOKENS
    max_waiting: int = 256
    enable_prefix_caching: bool = True
    # True: every layer keeps every token's KV; False (default): sliding-window layers keep only their
    # window where the cache allows it (kv/layout.py)
    disable_hybrid_kv_cache_manager: bool = False
    seed: int = 0  # for requests without a seed: makes a whole run reproducible
    attention: AttentionKind = "dense"
    # auto: Triton kernels on a GPU, the compiled C++ decode kernels on a CPU (PyTorch where they cannot
    # build); torch: the PyTorch references; triton on a CPU needs TRITON_INTERPRET=1 (tests)
    attention_kernels: AttentionKernels = "auto"
    sparse: SparseConfig = SparseConfig()
    # auto: the run dtype; int8 / int4: group-wise quantized (KIVI layout); fp8: e4m3 with per-head scales
    kv_dtype: KVDType = "auto"
    # overrides the model's RoPE scaling, e.g. {"type": "yarn", "factor": 4}
    rope_scaling: dict[str, float | str] | None = None
    context_overflow: ContextOverflow = "error"
    # a prompt longer than this many tokens keeps only this many tokens' KV once computed, chosen by
    # the attention its last 32 tokens give (SnapKV; kv/prune.py); None: every token's KV is kept
    kv_prune_budget: int | None = None
    # KV tiers below the device pool (cloud/engine/kv/tiers): evicted prefix blocks kept in host RAM
    # (GiB, 0: none) and on disk under a directory (None: none), bounded in GiB, LRU
    kv_host_memory_gib: float = 0.0
    kv_offload_dir: str | None = None
    kv_offload_disk_gib: float = 16.0
    kv_offload_dtype: OffloadDType = "auto"  # what the disk tier stores: the cache's bytes, or int8 / int4
    # the text of a Jinja chat template used instead of the model's (`--chat-template FILE`, as vLLM's)
    chat_template: str | None = None
    # speculative decoding (cloud/engine/speculative): ngram drafts tokens by prompt lookup (the
    # request's own context), verified in one forward; off: one token per step
    speculative: Speculative = "off"
    num_speculative_tokens: int = 3  # drafted tokens per step at most
    prompt_lookup_max: int = 4  # the longest n-gram looked up, tried first
    prompt_lookup_min: int = 2  # the shortest n-gram looked up
    # drafts only while at most this many requests run: a full batch already keeps the machine busy
    speculative_max_running: int = 4

    @property
    def torch_device(self) -> torch.device:
        from cloud.engine.runner.device import resolve_device

        return resolve_device(self.device)

    @property
    def run_dtype(self) -> str:
        from cloud.engine.runner.device import default_dtype

        return default_dtype(self.torch_device) if self.dtype == "auto" else self.dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.run_dtype)
        return dtype

    @property
    def kv_block_size(self) -> int:
        if self.block_size is not None:
            return self.block_size
        return 16 if self.kv_dtype in ("auto", "fp8") else 32
