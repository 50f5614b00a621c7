"""Where block-sparse attention loses a needle: per layer, whether the needle's blocks were selected,
how the Quest bound ranked them, and how much of the dense attention mass the selection kept.

A probe follows one request whose needle lies at token positions [start, end) of its prompt
(`ctxfuse bench longctx --probe`). SparseAttention calls it where it selects: at the prompt's last
prefill chunk (the far blocks its last queries pick, as seen by the last query, the one that writes
the first answer token) and at every decode step (the blocks each KV head picks). For each it
computes, from the same cache, the dense attention of that query over the whole context:

- selected: KV heads (of the layer's) that attend to a block holding needle tokens;
- rank: the needle's best block's place in its KV head's bound order among the candidate blocks (1 =
  the highest bound; 0 = the block is always attended: a sink or the recent window), best over heads;
- head rank: the same place in the bound order of the query head that gives the needle the most dense
  mass, its own bound alone (what selection per query head would see), best over the needle's blocks;
- mass kept: the share of the dense attention mass on the attended positions, mean over query heads;
- needle mass: the dense attention mass on the needle's tokens, highest over query heads: whether
  any head of the layer looks at the needle at all (if none does, losing it there costs nothing).

Only the first request of a step is followed (the benchmark runs one at a time). The probe's own
time is counted apart (`seconds`), so timings can leave it out.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import msgspec
import torch

from cloud.engine.attention.dense import AnyKVCache, context

if TYPE_CHECKING:
    from cloud.engine.attention.sparse import SparseAttention


class LayerTrace(msgspec.Struct, kw_only=True):
    """One layer's view of the needle. prefill_*: at the prompt's last query; decode_*: over every
    decode step (selected as a share of steps x KV heads, rank as the median of the steps' best)."""

    layer: int
    kv_heads: int
    prefill_selected: int | None = None  # KV heads attending to a needle block
    prefill_rank: int | None = None
    prefill_head_rank: int | None = None
    prefill_mass_kept: float | None = None
    prefill_needle_mass: float | None = None
    decode_steps: int = 0
    decode_selected: float | None = None
    decode_rank: float | None = None
    decode_head_rank: float | None = None
    decode_mass_kept: float | None = None
    decode_needle_mass: float | None = None


class _Pick:
    """One query's selection at one layer, measured."""

    __slots__ = ("head_rank", "mass_kept", "needle_mass", "rank", "selected")

    def __init__(
        self, selected: int, rank: int | None, head_rank: int | None, mass_kept: float, needle_mass: float
    ) -> None:
        self.selected, self.rank, self.head_rank = selected, rank, head_rank
        self.mass_kept, self.needle_mass = mass_kept, needle_mass


class SelectionProbe:
    def __init__(self) -> None:
        self.needle = (0, 0)
        self.prompt_len = 0
        self.seconds = 0.0
        self._prefill: dict[int, _Pick] = {}
        self._decode: dict[int, list[_Pick]] = {}
        self._kv_heads = 0

    def begin(self, needle: tuple[int, int], prompt_len: int) -> None:
        """Follow the next request: its needle's token span and its prompt's length."""
        self.needle, self.prompt_len = needle, prompt_len
        self._prefill, self._decode = {}, {}

    def finish(self) -> list[LayerTrace]:
        """What the probe saw of the request, per sparse layer."""
        out = []
        for layer in sorted(set(self._prefill) | set(self._decode)):
            t = LayerTrace(layer=layer, kv_heads=self._kv_heads)
            if (p := self._prefill.get(layer)) is not None:
                t.prefill_selected, t.prefill_rank, t.prefill_head_rank = p.selected, p.rank, p.head_rank
                t.prefill_mass_kept, t.prefill_needle_mass = round(p.mass_kept, 4), round(p.needle_mass, 4)
            steps = self._decode.get(layer, [])
            if steps:
                t.decode_steps = len(steps)
                t.decode_selected = round(sum(s.selected for s in steps) / (len(steps) * self._kv_heads), 4)
                ranks = [s.rank for s in steps if s.rank is not None]
                t.decode_rank = statistics.median(ranks) if ranks else None
                head_ranks = [s.head_rank for s in steps if s.head_rank is not None]
                t.decode_head_rank = statistics.median(head_ranks) if head_ranks else None
                t.decode_mass_kept = round(statistics.fmean(s.mass_kept for s in steps), 4)
                t.decode_needle_mass = round(statistics.fmean(s.needle_mass for s in steps), 4)
            out.append(t)
        self._prefill, self._decode = {}, {}
        return out

    # -- called by SparseAttention -----------------------------------------------------------

    def decode(
        self,
        sparse: SparseAttention,
        layer: int,
        q: torch.Tensor,
        cache: AnyKVCache,
        tables: torch.Tensor,
        lens: torch.Tensor,
        sel: torch.Tensor,
        keep: torch.Tensor,
        score: torch.Tensor,
    ) -> None:
        """A decode step's selection, row 0's: sel, keep [r, kvh, n] block positions; score [r, kvh,
        nb] the bounds it chose by."""
        t = time.perf_counter()
        n, bs, kvh = int(lens[0]), sparse.block_size, sparse.dense.num_kv_heads
        k, _ = context(cache, layer, tables[0], 0, n)  # [1, kvh, n, d]
        attended = torch.zeros(kvh, n, dtype=torch.bool)
        for h in range(kvh):
            for b in sel[0, h][keep[0, h]].tolist():
                attended[h, b * bs : (b + 1) * bs] = True
        middle = (sparse.sink_blocks, -(-n // bs) - sparse.window_blocks)
        qg = q[0].view(kvh, sparse.dense.group, -1)
        heads = sparse._bounds(layer, cache, qg, tables[0], heads=sparse.dense.group)  # [kvh, g, nb]
        pick = self._measure(sparse, qg, k[0], attended, score[0], heads, middle)
        self._decode.setdefault(layer, []).append(pick)
        self._kv_heads = kvh
        self.seconds += time.perf_counter() - t

    def prefill(
        self,
        sparse: SparseAttention,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        cache: AnyKVCache,
        table: torch.Tensor,
        start: int,
        far: torch.Tensor,
        near: int,
        score: torch.Tensor | None,
        observed: torch.Tensor | None,
    ) -> None:
        """A sparse prefill chunk's selection: q, k [n, heads | kv_heads, d] the chunk's; far [kvh, m]
        the far block positions attended (sinks, then picks); every position from block `near` on is
        attended; score [kvh, near - sinks] the key the picks were chosen by and observed [kvh, g * m,
        d] the queries that scored them (None: no picks). Only the prompt's last chunk is measured,
        at its last query."""
        if start + q.shape[0] != self.prompt_len:
            return
        t = time.perf_counter()
        bs, kvh, g = sparse.block_size, sparse.dense.num_kv_heads, sparse.dense.group
        kc, _ = context(cache, layer, table, 0, start)  # [1, kvh, start, d]
        keys = torch.cat([kc[0], k.transpose(0, 1).to(kc.dtype)], dim=1)  # [kvh, start + n, d]
        attended = torch.zeros(kvh, keys.shape[1], dtype=torch.bool)
        attended[:, near * bs :] = True
        for h in range(kvh):
            for b in far[h].tolist():
                attended[h, b * bs : (b + 1) * bs] = True
        sinks, nb = min(sparse.sink_blocks, near), -(-keys.shape[1] // bs)
        bounds = torch.full((kvh, nb), -torch.inf)
        heads = torch.full((kvh, g, nb), -torch.inf)
        if score is not None and observed is not None:
            bounds[:, sinks:near] = score
            # each query head's own bound over the observed queries
            heads[..., sinks:near] = sparse._bounds(layer, cache, observed, table[sinks:near], heads=g)
        last = q[-1].view(kvh, g, -1)
        pick = self._measure(sparse, last, keys, attended, bounds, heads, (sinks, near))
        self._prefill[layer] = pick
        self._kv_heads = kvh
        self.seconds += time.perf_counter() - t

    # -- the measures ------------------------------------------------------------------------

    def _measure(
        self,
        sparse: SparseAttention,
        qg: torch.Tensor,
        keys: torch.Tensor,
        attended: torch.Tensor,
        score: torch.Tensor,
        heads: torch.Tensor,
        candidates: tuple[int, int],
    ) -> _Pick:
        """qg [kvh, g, d] one query by KV head; keys [kvh, n, d]; attended [kvh, n]; score [kvh, nb]
        the bounds selection used; heads [kvh, g, nb] each query head's own; candidates: the block
        range [lo, hi) the bound chooses from."""
        n = keys.shape[1]
        logits = (qg.float() @ keys.float().transpose(-1, -2)) * sparse.dense.scale  # [kvh, g, n]
        probs = torch.softmax(logits, dim=-1)
        kept = (probs * attended[:, None, :]).sum(-1)  # [kvh, g]
        s, e = self.needle[0], min(self.needle[1], n)
        if e <= s:
            return _Pick(0, None, None, float(kept.mean()), 0.0)
        needle_mass = probs[..., s:e].sum(-1)
        selected = sum(bool(attended[h, s:e].any()) for h in range(attended.shape[0]))
        lo, hi, bs = *candidates, sparse.block_size
        blocks = range(s // bs, -(-e // bs))

        def rank(bounds: torch.Tensor, b: int) -> int:  # a sink or the window: attended whatever its bound
            return 0 if not lo <= b < hi else 1 + int((bounds[lo:hi] > bounds[b]).sum())

        best = min(rank(score[h], b) for h in range(score.shape[0]) for b in blocks)
        h, j = divmod(int(needle_mass.argmax()), needle_mass.shape[1])  # the head that looks hardest
        own = min(rank(heads[h, j], b) for b in blocks)
        return _Pick(selected, best, own, float(kept.mean()), float(needle_mass.max()))
