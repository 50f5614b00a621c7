"""The attention backend on a GPU: the same interface and results as DenseAttention and
SparseAttention (attention.py, sparse_attention.py), computed by the Triton kernels of
kernels/triton straight from the paged cache, with no gather copy.

- decode rows: paged_decode over a full-precision or fp8 cache, paged_decode_quant over an int8 /
  int4 cache (dequantized in registers), and, for sparse attention past its dense layers, Quest's
  selection (quest_select) then sparse_paged_decode. A row whose context fits in the sparse budget
  has every block selected, which is dense attention, as the PyTorch path does.
- prefill chunks: one varlen paged_prefill launch for all of a step's chunks (prefix from the
  blocks, causal inside the chunk) over a full-precision cache.
Every other case runs the PyTorch backend it wraps, which stays the reference: quantized and fp8
caches in prefill (their prefix is dequantized), sliding-window rows (their sinks are rotated), a
sparse prefill past the budget, and sparse top-p.
"""

from __future__ import annotations

import torch

from cloud.engine.attention.dense import AnyKVCache, AttentionMetadata
from cloud.engine.attention.kernel import KernelAttention
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.fp8_cache import Fp8KVCache
from cloud.engine.kv.quantized_cache import QuantizedKVCache
from kernels.triton.paged_decode import paged_decode
from kernels.triton.paged_decode_quant import paged_decode_quant
from kernels.triton.paged_prefill import paged_prefill
from kernels.triton.quest_select import quest_select
from kernels.triton.sparse_decode import sparse_paged_decode


class TritonAttention(KernelAttention):
    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: AnyKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if meta.decode_shift is not None or any(s.sink_shift for s in meta.prefills):
            return self.reference(layer, q, k, v, cache, meta)
        sparse = self.sparse_layer(layer)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            out[:nd] = self._decode(layer, q[:nd], cache, meta, sparse)
        if meta.prefills:
            ref = self.sparse
            past_budget = ref is not None and any(
                ref.sparse_prefill(layer, p.start_pos) for p in meta.prefills
            )
            if type(cache) is KVCache and meta.prefill_cu_q is not None and not past_budget:
                self._prefill(layer, q[nd:], cache, meta, out[nd:])
            else:
                self.prefill_rows(layer, q, k, v, cache, meta, out)
        return out

    def _decode(
        self, layer: int, q: torch.Tensor, cache: AnyKVCache, meta: AttentionMetadata, sparse: bool
    ) -> torch.Tensor:
        tables, lens = meta.decode_blocks, meta.decode_lens
        if tables is None or lens is None:
            raise ValueError("decode rows without block tables or lengths in the attention metadata")
        scale = self.dense.scale
        if isinstance(cache, QuantizedKVCache):
            if sparse:  # Quest over a quantized cache: the PyTorch path
                return self._reference_decode(layer, q, cache, meta)
            return paged_decode_quant(
                q,
                cache.kq[layer],
                cache.vq[layer],
                cache.summaries.kmin[layer],
                cache.summaries.kmax[layer],
                cache.vscale[layer],
                cache.vzero[layer],
                cache.stage_of,
                cache.stage_k[layer],
                cache.stage_v[layer],
                tables,
                lens,
                scale,
                cache.bits,
            )
        if isinstance(cache, Fp8KVCache):
            if sparse:
                return self._reference_decode(layer, q, cache, meta)
            kc, vc, ks, vs = cache.fp8_views(layer)
            return paged_decode(q, kc, vc, tables, lens, scale, k_scale=ks, v_scale=vs)
        kc, vc = cache.blocks_view(layer)
        if not sparse or self.sparse is None:
            return paged_decode(q, kc, vc, tables, lens, scale)
        s = self.sparse
        if s.config.top_p is not None or s.config.select != "group" or s.scored_by_parts(cache):
            # the Triton selection ranks by the group's bound over whole blocks, a fixed count per head:
            # the reference else
            return self._reference_decode(layer, q, cache, meta)
        # the layer's retrieval heads attend to every block: widened after the kernel
        selected = self.quest_selection(s, layer, q, cache, tables, lens, quest_select, widen=True)
        return sparse_paged_decode(q, kc, vc, tables, selected, lens, scale)

    def _reference_decode(
        self, layer: int, q: torch.Tensor, cache: AnyKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.sparse is not None:
            return self.sparse._decode(layer, q, cache, meta)
        blocks = meta.decode_blocks
        if blocks is None:
            raise ValueError("decode rows without block tables in the attention metadata")
        return self.dense.decode(layer, q, cache, blocks, meta.decode_mask)

    def _prefill(
        self, layer: int, q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, out: torch.Tensor
    ) -> None:
        """All prefill chunks in one launch; their keys and values are already in the cache."""
        if meta.prefill_cu_q is None or meta.prefill_start is None or meta.prefill_tables is None:
            raise ValueError("prefill rows without their varlen metadata")
        kc, vc = cache.blocks_view(layer)
        paged_prefill(
            q,
            kc,
            vc,
            meta.prefill_tables,
            meta.prefill_cu_q.to(torch.int32),
            meta.prefill_start,
            self.dense.scale,
            max_q_len=meta.max_prefill_len,
            out=out,
        )
