"""Block-sparse attention (Quest): each query attends to the attention sinks (the first blocks), a
recent window, and the middle blocks whose keys could score highest against it.

The bound for a block is Quest's: sum over channels of max(q * kmin, q * kmax), from the per-block
key min / max the cache keeps (key_summary.py), which is q+ . kmax + q- . kmin as two matmuls.
Blocks are chosen per KV head (the best bound over that head's query group), so the heads of a
group share one gather. Budgets are in tokens and rounded to whole blocks.

Exactness: a query whose context fits in the budget takes the dense path, so with a budget at least
the context length the outputs are the dense ones bit for bit. The first `dense_layers` layers are
always dense (early layers spread attention widely; the bound picks poorly there).

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
from cloud.engine.config import SparseConfig
from shared.errors import InvalidRequestError

OBSERVED_QUERIES = 64  # a prefill chunk's last queries that choose its far blocks


class SparseAttention:
    def __init__(self, dense: DenseAttention, config: SparseConfig, block_size: int) -> None:
        self.dense = dense
        self.config = config
        self.block_size = block_size
        self.sink_blocks = -(-config.sinks // block_size)
        self.window_blocks = -(-config.window // block_size)
        self.top_blocks = config.budget // block_size - self.sink_blocks - self.window_blocks
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
        if layer < self.config.dense_layers:
            return self.dense(layer, q, k, v, cache, meta)
        out = torch.empty_like(q)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(layer, q[: meta.num_decode], cache, meta)
        for seq in meta.prefills:
            rows = slice(seq.q_start, seq.q_start + seq.q_len)
            if seq.start_pos <= self.config.budget:
                out[rows] = self.dense.prefill(layer, q[rows], k[rows], v[rows], cache, seq, meta.sink_tokens)
            else:
                out[rows] = self._prefill(layer, q[rows], k[rows], v[rows], cache, seq, meta.sink_tokens)
        return out

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
        fewer middle blocks than the top count, or past top_p, pads with dropped entries)."""
        r, _, d = q.shape
        kvh, g, bs = self.dense.num_kv_heads, self.dense.group, self.block_size
        nb = tables.shape[1]
        nblk = (lens + bs - 1) // bs  # [r] real blocks per row
        dev = tables.device
        j = torch.arange(nb, device=dev)
        window_start = (nblk - self.window_blocks)[:, None]  # [r, 1]
        middle = (j >= self.sink_blocks) & (j[None, :] < window_start)  # [r, nb]
        qg = q.view(r, kvh, g, d)
        score = self._bounds(layer, cache, qg, tables)  # [r, kvh, nb]
        score = score.masked_fill(~middle[:, None, :], -torch.inf)
        top = score.topk(min(self.top_blocks, nb), dim=-1)  # [r, kvh, k]
        chosen = top.values > -torch.inf  # rows with fewer middle blocks than k pick padding
        if self.config.top_p is not None:
            chosen &= self._within_top_p(top.values)
        sinks = j[: self.sink_blocks].expand(r, kvh, -1)
        window = (window_start + torch.arange(self.window_blocks, device=dev)).unsqueeze(1).expand(r, kvh, -1)
        sel = torch.cat([sinks, top.indices, window], dim=-1)  # [r, kvh, n] block positions
        keep = torch.cat(
            [torch.ones_like(sinks, dtype=torch.bool), chosen, torch.ones_like(window, dtype=torch.bool)], -1
        )
        sel, order = sel.sort(dim=-1)  # context order, as dense reads it
        return sel, keep.gather(-1, order)

    def _bounds(self, layer: int, cache: AnyKVCache, qg: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Quest upper bounds. qg: [..., kvh, m, d] queries by KV head; tables: [..., nb] block ids
        -> [..., kvh, nb]: per block, the best bound over the m queries."""
        kmin, kmax = cache.key_bounds(layer)  # [kvh, blocks, d]
        bmin = kmin[:, tables].movedim(0, -3).float()  # [..., kvh, nb, d]
        bmax = kmax[:, tables].movedim(0, -3).float()
        qf = qg.float()
        ub = qf.clamp(min=0) @ bmax.transpose(-1, -2) + qf.clamp(max=0) @ bmin.transpose(-1, -2)
        return ub.amax(-2)

    def _within_top_p(self, scores: torch.Tensor) -> torch.Tensor:
        """scores: [..., k] bounds, best first -> the fewest leading blocks whose estimated share of
        attention (softmax of the scaled bounds) reaches top_p."""
        p = self.config.top_p or 1.0
        w = torch.softmax(scores * self.dense.scale, dim=-1).nan_to_num(0.0)
        before = w.cumsum(-1) - w
        return before < p

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
        if top > 0:
            obs = q[-OBSERVED_QUERIES:].transpose(0, 1)  # [heads, m, d]
            qg = obs.reshape(kvh, g * obs.shape[1], d)
            score = self._bounds(layer, cache, qg, table[sinks:near])  # [kvh, near - sinks]
            best = score.topk(top, dim=-1)
            if self.config.top_p is not None:  # one count for all heads: no mask in the flash call
                top = int(self._within_top_p(best.values).sum(-1).max())
            picked = best.indices[:, :top].sort(dim=-1).values + sinks
            far = torch.cat([far, picked], dim=-1)
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
