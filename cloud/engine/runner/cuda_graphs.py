"""CUDA graphs for decode steps: a decode step of the default model launches hundreds of small
kernels whose launch cost outweighs their work at small batches; replaying a captured graph
launches them all at once (vLLM and SGLang do the same).

Graphs are captured at start for batch sizes 1, 2, 4, 8, ... up to `--max-num-seqs` (and that size
itself), largest first, sharing one memory pool. A decode step of n requests replays the graph of
the smallest captured size >= n: its inputs are copied into the graphs' static buffers, and the
padding rows get context length 0 (attention reads nothing for them) and write their keys and
values to a spare block the block pool never hands out. Prefill and mixed steps run eagerly, as do
steps a graph cannot express (see `eligible` and `CudaGraphs.can_run`). `--enforce-eager` turns
graphs off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cloud.engine.attention.dense import AttentionMetadata, BoundAttention
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.fp8_cache import Fp8KVCache

if TYPE_CHECKING:
    from cloud.engine.attention.dense import AnyKVCache, AttentionBackend
    from cloud.engine.runner.model_runner import StepInputs
    from cloud.model.causal_lm import CausalLM


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... below max_num_seqs, and max_num_seqs itself."""
    sizes = []
    b = 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_num_seqs]


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The captured size a step of n decode rows replays, or None when n exceeds them all."""
    return next((s for s in sizes if s >= n), None)


def eligible(
    device: torch.device, enforce_eager: bool, cache: AnyKVCache, triton_attention: bool
) -> str | None:
    """Why decode steps cannot use graphs here, or None when they can."""
    if device.type != "cuda":
        return "not a CUDA device"
    if enforce_eager:
        return "--enforce-eager"
    if not triton_attention:
        return "attention does not run the Triton kernels"
    if not isinstance(cache, KVCache | Fp8KVCache) or cache.summaries is not None:
        # quantized caches plan their writes on the host; key summaries index data-dependently
        return "the KV cache plans its writes on the host (int8 / int4, or sparse attention's summaries)"
    return None


class CudaGraphs:
    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        attention: AttentionBackend,
        max_num_seqs: int,
        max_blocks: int,
        spare_slot: int,
    ) -> None:
        self.model = model
        self.cache = cache
        self.attention = attention
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = max_blocks
        self.spare_slot = spare_slot  # a slot of a block the pool never hands out
        dev = model.device
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), spare_slot, dtype=torch.long, device=dev)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.long, device=dev)
        self.lens = torch.zeros(n, dtype=torch.long, device=dev)
        self.rows = torch.arange(n, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.max_position = model.rope.max_positions - 1

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slots[:b], b, self.tables[:b], None, [], self.lens[:b])
        meta.max_decode_len = self.max_blocks * self.cache.block_size
        bound = BoundAttention(self.attention, self.cache, meta)
        return self.model.forward(self.ids[:b], self.positions[:b], bound, self.rows[:b], self.max_position)

    def capture(self) -> None:
        pool = None
        for b in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory
            self._forward(b)  # warm-up: compiles kernels, settles lazy allocations
            torch.cuda.synchronize(self.model.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = g.pool()
            self.graphs[b] = g
        torch.cuda.synchronize(self.model.device)

    def can_run(self, step: StepInputs) -> bool:
        meta = step.meta
        return (
            not meta.prefills
            and meta.decode_shift is None
            and not step.prompt_rows
            and meta.decode_blocks is not None
            and meta.decode_blocks.shape[1] <= self.max_blocks
            and step.max_position <= self.max_position
            and padded_size(meta.num_decode, self.sizes) is not None
        )

    def run(self, step: StepInputs) -> torch.Tensor:
        """Replay the graph for the step's padded size; fp32 logits [decode rows, vocab]."""
        meta = step.meta
        n = meta.num_decode
        b = padded_size(n, self.sizes)
        if b is None or meta.decode_blocks is None or meta.decode_lens is None:
            raise ValueError("this step cannot replay a CUDA graph")
        w = meta.decode_blocks.shape[1]
        self.ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.tables[:n, :w].copy_(meta.decode_blocks)
        self.lens[:n].copy_(meta.decode_lens)
        if b > n:  # padding rows: nothing to attend to, their writes go to the spare block
            self.ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slots[n:b].fill_(self.spare_slot)
            self.lens[n:b].zero_()
        self.graphs[b].replay()
        return self.outputs[b][:n]
