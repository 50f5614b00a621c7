"""What the kernel attention backends share (triton_attention.py on a GPU, cpu_attention.py on a
CPU): each wraps the PyTorch backend it accelerates, which stays the reference and serves every case
its kernels do not cover. Prefill chunks they leave to it run here, one chunk at a time, through
the same dense or sparse path the reference itself would take."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cloud.engine.attention.dense import AnyKVCache, AttentionMetadata, DenseAttention, PrefillSeq
from cloud.engine.attention.reselect import SelectionReuse
from cloud.engine.attention.sparse import SparseAttention

# a Quest selection kernel (kernels/triton/quest_select.py, kernels/cpu/quest_select.py): q, kmin,
# kmax, tables, lens, sink blocks, window blocks, top blocks, block_size= -> [r, kv_heads, n] positions
QuestSelect = Callable[..., torch.Tensor]


class KernelAttention:
    def __init__(self, reference: DenseAttention | SparseAttention) -> None:
        self.reference = reference
        self.sparse = reference if isinstance(reference, SparseAttention) else None
        self.dense = reference.dense if isinstance(reference, SparseAttention) else reference
        # the selection kernel's choices, taken again for `reselect` tokens (reselect.py)
        s = self.sparse
        every, block_size = (s.config.reselect, s.block_size) if s is not None else (1, 1)
        self.reuse: SelectionReuse[torch.Tensor] = SelectionReuse(every, block_size)

    def sparse_layer(self, layer: int) -> bool:
        """Whether this layer attends sparsely (sparse attention, past its dense layers)."""
        return self.sparse is not None and layer >= self.sparse.dense_layers

    def quest_selection(
        self,
        s: SparseAttention,
        layer: int,
        q: torch.Tensor,
        cache: AnyKVCache,
        tables: torch.Tensor,
        lens: torch.Tensor,
        select: QuestSelect,
        widen: bool = False,
        **options: object,
    ) -> torch.Tensor:
        """[r, kv_heads, n] block positions (-1: none) from a Quest selection kernel, or the ones it chose
        for this layer a few tokens ago where they still stand; `options` go to the kernel. widen: the
        kernel leaves the layer's retrieval heads to this (they take every block of the table)."""
        kept = self.reuse.lookup(layer, tables, lens)
        if kept is not None:
            return kept
        kmin, kmax = cache.key_bounds(layer)
        selected = select(
            q,
            kmin,
            kmax,
            tables,
            lens,
            s.sink_blocks,
            s.window_blocks,
            s.top_blocks,
            block_size=cache.block_size,
            **options,
        )
        if widen and layer in s.dense_prefill:
            selected = s.with_retrieval_heads(layer, selected, tables.shape[1])
        self.reuse.keep(layer, selected)
        return selected

    def reference_prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: AnyKVCache,
        seq: PrefillSeq,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One chunk as the reference computes it: q: [n, heads, d]; k, v: [n, kv_heads, d]."""
        s = self.sparse
        if s is not None and s.sparse_prefill(layer, seq.start_pos):
            return s._prefill(layer, q, k, v, cache, seq, meta.sink_tokens)
        return self.dense.prefill(layer, q, k, v, cache, seq, meta.sink_tokens)

    def prefill_rows(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: AnyKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """Every prefill chunk of the step into out's rows: through `prefill_kernel` where it takes
        the chunk, else through the reference."""
        for seq in meta.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            if not self.prefill_kernel(layer, q[rows], cache, seq, out[rows]):
                out[rows] = self.reference_prefill(layer, q[rows], k[rows], v[rows], cache, seq, meta)

    def prefill_kernel(
        self, layer: int, q: torch.Tensor, cache: AnyKVCache, seq: PrefillSeq, out: torch.Tensor
    ) -> bool:
        """Attend one chunk (q: [n, heads, d], its keys and values already in the cache) with the
        backend's own kernel into out, or return False for the reference. None here: the Triton
        backend runs the step's chunks in one varlen launch before it comes to this."""
        return False
