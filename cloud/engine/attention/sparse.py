"""Block-sparse attention (Quest): each query attends to the attention sinks (the first blocks), a
recent window, and the middle blocks whose keys could score highest against it.

The bound for a block is Quest's: sum over channels of max(q * kmin, q * kmax), from the per-block
key min / max the cache keeps (key_summary.py), which is q+ . kmax + q- . kmin as two matmuls.
Blocks are chosen per KV head, so the heads of a group share one gather: by the best bound over
that head's query group, or (`select="head"`) by each block's best place in any of its query heads'
own bound orders. Budgets are in tokens and rounded to whole blocks.

Retrieval heads (retrieval_heads.py, DuoAttention's split): KV heads that a calibration found
fetching facts from far back attend to every block, the others as above; a layer holding one
prefills densely.

Re-selection (`config.reselect`, reselect.py): a decode step may take the blocks each layer chose a
few tokens before, until the row opens a block or the batch changes.

Scoring blocks (`config.score_block`): a block may keep a key summary per part of it (key_summary.py);
its bound is then its best part's, never looser than the whole block's, and the same blocks are read.

Exactness: a query whose context fits in the budget takes the dense path, so with a budget at least
the context length the outputs are the dense ones bit for bit. The first `dense_layers` layers are
dense (early layers spread attention widely; the bound picks poorly there): two by default, none
where retrieval heads are dense, which keep what those layers need.

Prefill: a chunk after more than `budget` cached tokens attends to sinks + the top blocks of the
far prefix (scored by the chunk's last queries, which carry the question when the chunk is the
prompt's end) + the recent window, all unmasked, and to itself causally: two flash calls merged by
their log-sum-exps, as dense prefill does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cloud.engine.attention.dense import (
    AnyKVCache,
    AttentionMetadata,
    DenseAttention,
    PrefillSeq,
    context,
    shift_sinks,
)
from cloud.engine.attention.reselect import SelectionReuse
from cloud.engine.attention.sparse_probe import SelectionProbe
from cloud.engine.config import DENSE_LAYERS, SparseConfig
from cloud.engine.kv.cache import KVCache
from shared.errors import InvalidRequestError

OBSERVED_QUERIES = 64  # a prefill chunk's last queries that choose its far blocks


class SparseAttention:
    def __init__(
        self,
        dense: DenseAttention,
        config: SparseConfig,
        block_size: int,
        dense_heads: torch.Tensor | None = None,
    ) -> None:
        self.dense = dense
        self.config = config
        self.block_size = block_size
        self.sink_blocks = -(-config.sinks // block_size)
        self.window_blocks = -(-config.window // block_size)
        self.top_blocks = config.budget // block_size - self.sink_blocks - self.window_blocks
        self.probe: SelectionProbe | None = None  # a diagnostic (`bench longctx --probe`), never served
        # [layers, kv_heads] bool: retrieval heads (retrieval_heads.py), attended densely; a layer with
        # one prefills densely (a flash call takes one key set for all heads)
        self.dense_heads = dense_heads
        with_dense = [] if dense_heads is None else dense_heads.any(-1).nonzero()[:, 0].tolist()
        self.dense_prefill = set(with_dense)
        # the first layers attended densely: config.dense_layers, or by default none beside retrieval heads
        default = DENSE_LAYERS if dense_heads is None else 0
        self.dense_layers = default if config.dense_layers is None else config.dense_layers
        if config.reselect < 1:
            raise InvalidRequestError(f"--sparse-reselect must be at least 1 token, not {config.reselect}")
        # this path's selections, taken again for `reselect` tokens (the probe watches fresh ones only)
        self.reuse: SelectionReuse[tuple[torch.Tensor, torch.Tensor]] = SelectionReuse(
            config.reselect, block_size
        )
        if self.top_blocks < 0:
            raise InvalidRequestError(
                f"the sparse budget ({config.budget} tokens) must cover the sinks ({config.sinks}) "
                f"and the window ({config.window}) in whole {block_size}-token blocks"
            )

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: AnyKVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if layer < self.dense_layers:
            return self.dense(layer, q, k, v, cache, meta)
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(layer, q[: meta.num_decode], cache, meta)
        for seq in meta.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            if not self.sparse_prefill(layer, seq.start_pos):
                out[rows] = self.dense.prefill(layer, q[rows], k[rows], v[rows], cache, seq, meta.sink_tokens)
            else:
                out[rows] = self._prefill(layer, q[rows], k[rows], v[rows], cache, seq, meta.sink_tokens)
        return out

    @staticmethod
    def of(backend: object) -> SparseAttention | None:
        """The sparse reference inside an attention backend (itself, or what a kernel backend wraps)."""
        if isinstance(backend, SparseAttention):
            return backend
        inner = getattr(backend, "sparse", None)
        return inner if isinstance(inner, SparseAttention) else None

    def sparse_prefill(self, layer: int, start_pos: int) -> bool:
        """Whether a prefill chunk after `start_pos` cached tokens attends sparsely at `layer`: past the
        budget, past the dense layers, in a layer without retrieval heads. Every backend asks this."""
        return (
            start_pos > self.config.budget and layer >= self.dense_layers and layer not in self.dense_prefill
        )

    # -- decode -----------------------------------------------------------------------------

    def _decode(
        self, layer: int, q: torch.Tensor, cache: AnyKVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        blocks, mask, lens = meta.decode_blocks, meta.decode_mask, meta.decode_lens
        if blocks is None or lens is None:
            raise ValueError("decode rows without block tables or lengths in the attention metadata")
        shift, sinks = meta.decode_shift, meta.sink_tokens
        sparse = lens > self.config.budget
        if not bool(sparse.any()):
            return self.dense.decode(layer, q, cache, blocks, mask, shift, sinks)
        out = torch.empty_like(q)
        rows = sparse.nonzero().squeeze(1)
        out[rows] = self._sparse_decode(
            layer, q[rows], cache, blocks[rows], lens[rows], None if shift is None else shift[rows], sinks
        )
        rest = (~sparse).nonzero().squeeze(1)
        if rest.numel():
            out[rest] = self.dense.decode(
                layer,
                q[rest],
                cache,
                blocks[rest],
                None if mask is None else mask[rest],
                None if shift is None else shift[rest],
                sinks,
            )
        return out

    def _sparse_decode(
        self,
        layer: int,
        q: torch.Tensor,
        cache: AnyKVCache,
        tables: torch.Tensor,
        lens: torch.Tensor,
        shift: torch.Tensor | None = None,
        sink_tokens: int = 0,
    ) -> torch.Tensor:
        """q: [r, heads, d]; tables: [r, nb] (padded); lens: [r] context lengths, all > budget;
        shift: [r] sliding-window rows' dropped tokens (their sink blocks come first in `sel`)."""
        r, h, d = q.shape
        kvh, g, bs = self.dense.num_kv_heads, self.dense.group, self.block_size
        sel, keep = self.select(layer, q, cache, tables, lens)
        ids = tables[:, None, :].expand(r, kvh, tables.shape[1]).gather(-1, sel)  # [r, kvh, n] block ids
        k, v = cache.gather_per_head(layer, ids)  # [r, kvh, n * bs, d]
        if shift is not None and bool(shift.any()):
            k = shift_sinks(self.dense.rope, k, shift.view(r, 1), sink_tokens)
        pos = sel.unsqueeze(-1) * bs + torch.arange(bs, device=tables.device)  # [r, kvh, n, bs]
        valid = (pos < lens.view(r, 1, 1, 1)) & keep.unsqueeze(-1)
        mask = valid.flatten(-2).unsqueeze(2)  # [r, kvh, 1, n * bs]
        o = F.scaled_dot_product_attention(q.view(r, kvh, g, d), k, v, attn_mask=mask, scale=self.dense.scale)
        return o.reshape(r, h, d)

    def select(
        self, layer: int, q: torch.Tensor, cache: AnyKVCache, tables: torch.Tensor, lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Which blocks each (row, KV head) attends to: block positions [r, kvh, n] in context order
        (sinks, the top middle blocks, the window) and whether each is kept [r, kvh, n] (a row with
        fewer middle blocks than the top count, or past top_p, pads with dropped entries). Taken from
        an earlier step while it stands (`config.reselect`, reselect.py)."""
        kept = None if self.probe is not None else self.reuse.lookup(layer, tables, lens)
        if kept is not None:
            return kept
        r, _, d = q.shape
        kvh, g, bs = self.dense.num_kv_heads, self.dense.group, self.block_size
        nb = tables.shape[1]
        nblk = (lens + bs - 1) // bs  # [r] real blocks per row
        dev = tables.device
        j = torch.arange(nb, device=dev)
        window_start = (nblk - self.window_blocks)[:, None]  # [r, 1]
        middle = (j >= self.sink_blocks) & (j[None, :] < window_start)  # [r, nb]
        qg = q.view(r, kvh, g, d)
        bound, key = self._scored(layer, cache, qg, tables, ~middle[:, None, :])  # [r, kvh, nb]
        top = key.topk(min(self.top_blocks, nb), dim=-1)  # [r, kvh, k]
        chosen = top.values > -torch.inf  # rows with fewer middle blocks than k pick padding
        if self.config.top_p is not None:
            chosen &= self._within_top_p(bound.gather(-1, top.indices))
        sinks = j[: self.sink_blocks].expand(r, kvh, -1)
        window = (window_start + torch.arange(self.window_blocks, device=dev)).unsqueeze(1).expand(r, kvh, -1)
        sel = torch.cat([sinks, top.indices, window], dim=-1)  # [r, kvh, n] block positions
        keep = torch.cat(
            [torch.ones_like(sinks, dtype=torch.bool), chosen, torch.ones_like(window, dtype=torch.bool)], -1
        )
        sel, order = sel.sort(dim=-1)  # context order, as dense reads it
        keep = keep.gather(-1, order)
        if layer in self.dense_prefill and self.dense_heads is not None:  # retrieval heads take every block
            retrieval = self.dense_heads[layer].view(1, kvh, 1)
            pad = nb - sel.shape[-1]  # > 0: a sparse row's context is past the budget
            if pad > 0:  # the sparse heads' rows, widened with dropped entries
                sel = torch.cat([sel, sel[..., -1:].expand(r, kvh, pad)], dim=-1)
                keep = torch.cat([keep, torch.zeros_like(keep[..., :1]).expand(r, kvh, pad)], dim=-1)
            every = j[: sel.shape[-1]].expand(r, kvh, -1)
            live = every < nblk.view(r, 1, 1)
            sel, keep = torch.where(retrieval, every, sel), torch.where(retrieval, live, keep)
        if self.probe is not None:
            self.probe.decode(self, layer, q, cache, tables, lens, sel, keep, key)
        else:
            self.reuse.keep(layer, (sel, keep))
        return sel, keep

    def with_retrieval_heads(self, layer: int, selected: torch.Tensor, nb: int) -> torch.Tensor:
        """A kernel's selection, [r, kvh, n] block positions (-1: none), with this layer's retrieval
        heads taking every position of an nb-block table: [r, kvh, max(n, nb)], the rest padded with
        -1 (positions past a row's context are the kernel's to mask)."""
        if self.dense_heads is None:
            return selected
        r, kvh, n = selected.shape
        width = max(n, nb)
        if width > n:
            selected = F.pad(selected, (0, width - n), value=-1)
        every = torch.arange(width, device=selected.device, dtype=selected.dtype).expand(r, kvh, width)
        return torch.where(self.dense_heads[layer].view(1, kvh, 1), every, selected)

    def _bounds(
        self, layer: int, cache: AnyKVCache, qg: torch.Tensor, tables: torch.Tensor, heads: int = 0
    ) -> torch.Tensor:
        """Quest upper bounds. qg: [..., kvh, m, d] queries by KV head; tables: [..., nb] block ids
        -> [..., kvh, nb]: per block, the best bound over the m queries. With `heads`, the m rows are
        that many query heads' runs of queries, each bounded apart: -> [..., kvh, heads, nb]. A block
        kept in parts is bounded by its best part."""
        kmin, kmax = cache.key_bounds(layer)  # [kvh, blocks, d], or [kvh, blocks, parts, d]
        if kmin.dim() == 3:  # one summary per block: one part
            kmin, kmax = kmin.unsqueeze(2), kmax.unsqueeze(2)
        parts = kmin.shape[2]
        # every part in a row of its own, bounded apart: [..., kvh, nb * parts, d]
        bmin = kmin[:, tables].movedim(0, -4).flatten(-3, -2).float()
        bmax = kmax[:, tables].movedim(0, -4).flatten(-3, -2).float()
        qf = qg.float()
        if heads:
            qf, bmin, bmax = qf.unflatten(-2, (heads, -1)), bmin.unsqueeze(-3), bmax.unsqueeze(-3)
        ub = (qf.clamp(min=0) @ bmax.transpose(-1, -2) + qf.clamp(max=0) @ bmin.transpose(-1, -2)).amax(-2)
        return ub.unflatten(-1, (-1, parts)).amax(-1)

    @staticmethod
    def scored_by_parts(cache: AnyKVCache) -> bool:
        """Whether the cache keeps several key summaries per block (kv/memory.py `summary_parts` decides
        and refuses what cannot be kept); the compiled selections take one per block."""
        return isinstance(cache, KVCache) and cache.summaries is not None and cache.summaries.parts > 1

    def _scored(
        self, layer: int, cache: AnyKVCache, qg: torch.Tensor, tables: torch.Tensor, drop: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's bound of each block and the key selection ranks it by, [..., kvh, nb], -inf
        where `drop`. qg: [..., kvh, g * m, d], each query head's m queries in a run. By group, the
        key is the bound; by head, it is the block's best place in any query head's own bound order
        (its negated rank), so each head's likeliest blocks come first whatever its bounds' scale."""
        if self.config.select == "group":
            bound = self._bounds(layer, cache, qg, tables)
            bound = bound if drop is None else bound.masked_fill(drop, -torch.inf)
            return bound, bound
        per_head = self._bounds(layer, cache, qg, tables, heads=self.dense.group)  # [..., kvh, g, nb]
        if drop is not None:
            per_head = per_head.masked_fill(drop.unsqueeze(-2), -torch.inf)
        order = per_head.argsort(dim=-1, descending=True)
        places = torch.arange(order.shape[-1], device=order.device).expand_as(order)
        rank = torch.empty_like(order).scatter_(-1, order, places).amin(-2)  # [..., kvh, nb]
        bound = per_head.amax(-2)
        key = (-rank).to(bound.dtype).masked_fill(bound == -torch.inf, -torch.inf)
        return bound, key

    def _within_top_p(self, scores: torch.Tensor) -> torch.Tensor:
        """scores: [..., k] bounds -> the fewest blocks, highest bound first, whose estimated share of
        attention (softmax of the scaled bounds) reaches top_p."""
        p = self.config.top_p or 1.0
        ordered, order = scores.sort(dim=-1, descending=True)
        w = torch.softmax(ordered * self.dense.scale, dim=-1).nan_to_num(0.0)
        within = (w.cumsum(-1) - w) < p
        return torch.empty_like(within).scatter_(-1, order, within)

    # -- prefill ----------------------------------------------------------------------------

    def _prefill(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: AnyKVCache,
        seq: PrefillSeq,
        sink_tokens: int = 0,
    ) -> torch.Tensor:
        """q: [n, heads, d]; k, v: [n, kv_heads, d] the chunk's own; seq.start_pos > budget."""
        d = q.shape[-1]
        kvh, g, bs = self.dense.num_kv_heads, self.dense.group, self.block_size
        start, table = seq.start_pos, seq.block_table
        near = max(0, (start - self.config.window) // bs)  # far blocks: [0, near); exact from near * bs
        sinks = min(self.sink_blocks, near)
        far = torch.arange(sinks, device=table.device).expand(kvh, -1)  # [kvh, sinks] block positions
        top = min(self.top_blocks, near - sinks)
        score = qg = None
        if top > 0:
            obs = q[-OBSERVED_QUERIES:].transpose(0, 1)  # [heads, m, d]
            qg = obs.reshape(kvh, g * obs.shape[1], d)
            bound, score = self._scored(layer, cache, qg, table[sinks:near], None)  # [kvh, near - sinks]
            best = score.topk(top, dim=-1)
            if self.config.top_p is not None:  # one count for all heads: no mask in the flash call
                top = int(self._within_top_p(bound.gather(-1, best.indices)).sum(-1).max())
            picked = best.indices[:, :top].sort(dim=-1).values + sinks
            far = torch.cat([far, picked], dim=-1)
        if self.probe is not None:
            self.probe.prefill(self, layer, q, k, cache, table, start, far, near, score, qg)
        kr, vr = context(cache, layer, table, near * bs, start)  # [1, kvh, start - near * bs, d]
        if far.shape[1]:
            kf, vf = cache.gather_per_head(layer, table[far])  # [kvh, far * bs, d]
            if seq.sink_shift:  # a sliding-window request: its sink blocks lead `far`
                kf = shift_sinks(self.dense.rope, kf, torch.tensor(seq.sink_shift), sink_tokens)
            kr, vr = torch.cat([kf[None], kr], dim=2), torch.cat([vf[None], vr], dim=2)
        qh = q.transpose(0, 1).unsqueeze(0)
        kc, vc = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        o = self.dense.prefix_then_chunk(qh, kr, vr, kc, vc)
        return o[0].transpose(0, 1)
