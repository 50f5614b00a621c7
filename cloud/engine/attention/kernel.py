"""What the kernel attention backends share (triton_attention.py on a GPU, cpu_attention.py on a
CPU): each wraps the PyTorch backend it accelerates, which stays the reference and serves every case
its kernels do not cover. Prefill chunks they leave to it run here, one chunk at a time, through
the same dense or sparse path the reference itself would take."""

from __future__ import annotations

import torch

from cloud.engine.attention.dense import AnyKVCache, AttentionMetadata, DenseAttention, PrefillSeq
from cloud.engine.attention.sparse import SparseAttention


class KernelAttention:
    def __init__(self, reference: DenseAttention | SparseAttention) -> None:
        self.reference = reference
        self.sparse = reference if isinstance(reference, SparseAttention) else None
        self.dense = reference.dense if isinstance(reference, SparseAttention) else reference

    def sparse_layer(self, layer: int) -> bool:
        """Whether this layer attends sparsely (sparse attention, past its dense layers)."""
        return self.sparse is not None and layer >= self.sparse.config.dense_layers

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
