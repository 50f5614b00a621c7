"""The attention backend on a CPU with the compiled kernels (kernels/cpu/paged_attention.py): decode
rows read the paged cache in place, dequantize int8 / int4 codes in registers and attend over
Quest's selected blocks (chosen by kernels/cpu/quest_select.py) without gathering them, threaded over
(request, KV head, context split);
prefill chunks over an fp32 cache attend causally to the cached prefix and themselves in place,
threaded over (KV head, run of positions), 2x PyTorch's CPU flash kernel at 7K; a chunk of a few
positions (a verify step: 1 + drafts) takes the decode kernel's multi-query form instead, one pass
over the context for all of its rows, split over the threads. It is the PyTorch
backend it wraps everywhere else, and that stays the reference: fp8 caches, sliding-window rows
(their sinks are rotated), a sparse step over a quantized cache with rows within the budget, prefill
over a quantized cache (the reference attends to the chunk's own keys unrounded) and sparse prefill
past the budget.
"""

from __future__ import annotations

import torch

from cloud.engine.attention.dense import AnyKVCache, AttentionMetadata, DenseAttention, PrefillSeq
from cloud.engine.attention.kernel import KernelAttention
from cloud.engine.attention.sparse import SparseAttention
from cloud.engine.kv.cache import KVCache
from cloud.engine.kv.fp8_cache import Fp8KVCache
from cloud.engine.kv.quantized_cache import QuantizedKVCache
from kernels.cpu import quest_select
from kernels.cpu.paged_attention import (
    paged_decode_cpu,
    paged_decode_quant_cpu,
    prefill_attention_cpu,
    sparse_paged_decode_cpu,
)

# A chunk of at most this many query rows (positions x the query heads of a KV head) goes to the
# multi-query decode kernel: below it, the prefill kernel's rows-in-lanes tiles are mostly empty
# lanes (measured at 1K and 4K, AVX2 and AVX-512: up to 3 positions of 3 heads, the decode kernel is
# faster; at 4 they are even; from 5 the prefill kernel)
MULTI_QUERY_ROWS = 10


class CpuKernelAttention(KernelAttention):
    def __init__(self, reference: DenseAttention | SparseAttention) -> None:
        super().__init__(reference)
        # the compiled Quest selection, built or loaded at start: no long request waits for it
        self.quest = self.sparse is not None and quest_select.available()

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: AnyKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        nd = meta.num_decode
        if meta.decode_shift is not None or isinstance(cache, Fp8KVCache):
            return self.reference(layer, q, k, v, cache, meta)
        decode = None
        if nd:
            tables, lens = meta.decode_blocks, meta.decode_lens
            if tables is None or lens is None:
                raise ValueError("decode rows without block tables or lengths in the attention metadata")
            decode = self._decode(layer, q[:nd], cache, tables, lens)
            if decode is None:
                return self.reference(layer, q, k, v, cache, meta)
            if not meta.prefills:
                return decode
        out = torch.empty_like(q)
        if decode is not None:
            out[:nd] = decode
        self.prefill_rows(layer, q, k, v, cache, meta, out)
        return out

    def prefill_kernel(
        self, layer: int, q: torch.Tensor, cache: AnyKVCache, seq: PrefillSeq, out: torch.Tensor
    ) -> bool:
        """The C++ prefill kernel takes a chunk over an fp32 cache (it reads the chunk's own keys
        there, as written) with dense attention (the reference's sparse prefill starts past the
        budget) and no dropped window."""
        s = self.sparse
        if (
            type(cache) is not KVCache  # quantized or fp8: the reference keeps the chunk's keys unrounded
            or cache.dtype != torch.float32
            or q.dtype != torch.float32
            or seq.sink_shift
            or (s is not None and s.sparse_prefill(layer, seq.start_pos))
        ):
            return False
        kc, vc = cache.blocks_view(layer)
        if seq.q_len * self.dense.group <= MULTI_QUERY_ROWS:
            # a verify step's few positions: the decode kernel's one pass over the context for all
            # of them, split over the threads
            length = torch.tensor([seq.start_pos + seq.q_len], dtype=torch.int32)
            table = seq.block_table[None]
            # every layer reads the same table and length: checked once, at layer 0 (as decode rows)
            rows = paged_decode_cpu(q[None], kc, vc, table, length, self.dense.scale, check=layer == 0)
            out.copy_(rows[0])
            return True
        prefill_attention_cpu(q, kc, vc, seq.block_table, seq.start_pos, self.dense.scale, out=out)
        return True

    def _decode(
        self, layer: int, q: torch.Tensor, cache: AnyKVCache, tables: torch.Tensor, lens: torch.Tensor
    ) -> torch.Tensor | None:
        """Decode rows with the kernels, or None where the reference must run."""
        scale = self.dense.scale
        s = self.sparse
        sparse = self.sparse_layer(layer)
        if isinstance(cache, QuantizedKVCache):
            selected = None
            if sparse and s is not None:
                if not bool((lens > s.config.budget).all()):  # rows within the budget among them
                    return None
                selected = self._select(s, layer, q, cache, tables, lens)
            return paged_decode_quant_cpu(
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
                selected=selected,
            )
        if not isinstance(cache, KVCache):
            return None
        kc, vc = cache.blocks_view(layer)
        if not sparse or s is None:
            # every layer of a step reads the same tables with the same shapes: checked once, at layer 0
            return paged_decode_cpu(q, kc, vc, tables, lens, scale, check=layer == 0)
        # Quest's selection, then attention over the picked blocks in place; a row within the budget
        # attends densely, as the reference does
        over = lens > s.config.budget
        if bool(over.all()):  # a step of long requests only: no rows to split
            selected = self._select(s, layer, q, cache, tables, lens)
            return sparse_paged_decode_cpu(q, kc, vc, tables, selected, lens, scale)
        out = torch.empty_like(q)
        rows = over.nonzero().squeeze(1)
        if rows.numel():
            q_r, tables_r, lens_r = q[rows], tables[rows], lens[rows]
            selected = self._select(s, layer, q_r, cache, tables_r, lens_r)
            out[rows] = sparse_paged_decode_cpu(q_r, kc, vc, tables_r, selected, lens_r, scale)
        rest = (~over).nonzero().squeeze(1)
        if rest.numel():
            out[rest] = paged_decode_cpu(q[rest], kc, vc, tables[rest], lens[rest], scale)
        return out

    def _select(
        self,
        s: SparseAttention,
        layer: int,
        q: torch.Tensor,
        cache: AnyKVCache,
        tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        """[r, kv_heads, n] int32 block positions (-1: none) for the sparse decode kernel: the compiled
        Quest selection (kernels/cpu/quest_select.cpp, 3-4x faster than PyTorch's in a 16K step)
        where it applies (the group's bound, a fixed count, a summary per block, no probe watching),
        else the reference's;
        either taken again for `reselect` tokens."""
        c = s.config
        if (
            self.quest
            and c.select == "group"
            and c.top_p is None
            and not s.scored_by_parts(cache)
            and s.probe is None
        ):
            every = s.dense_heads[layer] if s.dense_heads is not None and layer in s.dense_prefill else None
            return self.quest_selection(
                s,
                layer,
                q,
                cache,
                tables,
                lens,
                quest_select.quest_select_cpu,
                every=every,
                check=layer == s.dense_layers,  # every sparse layer reads the same tables: checked once
            )
        sel, keep = s.select(layer, q, cache, tables, lens)
        return torch.where(keep, sel, -1).to(torch.int32)
