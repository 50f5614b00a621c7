"""Re-selection every few decode tokens (`SparseConfig.reselect`, `--sparse-reselect N`): a sparse
decode step may attend to the blocks each layer chose up to N - 1 tokens earlier instead of choosing
again from its own query.

Quest chooses at every step, and choosing is about a fifth of a sparse step's attention at 16K on a
CPU. Taking each selection for 4 tokens changed no answer of `ctxfuse bench longctx` from 2K to 16K
(docs/benchmarks.md, "Usable context"). A selection stands only while nothing it was chosen over has
changed but the length within its last block:
- the same rows, each with the same block table;
- each row 1 to N - 1 tokens past the step that chose, with no block opened since: the window,
  which is part of every selection, holds the newest block, so a row that opens a block chooses
  again (with 16-token blocks, N past 16 changes nothing).
Anything else (a row joining or leaving, a table changed by preemption or a new block) chooses
afresh for every layer. The decision is made once a step, at the first layer that asks; each layer
keeps its own selection."""

from __future__ import annotations

from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class SelectionReuse(Generic[T]):
    """One attention path's selections (a kernel's positions, or the reference's positions and
    keep mask), per layer, and whether this step may take them."""

    def __init__(self, every: int, block_size: int) -> None:
        if every < 1:
            raise ValueError(f"re-selection every {every} tokens: it must be at least 1")
        self.every = every
        self.block_size = block_size
        self.chosen = 0  # steps that chose afresh (a test's and a benchmark's count)
        self.reused = 0  # steps that took the earlier selection
        self._layer = -1  # the last layer asked: a lower or equal one starts a step
        self._tables: torch.Tensor | None = None  # the rows' tables when they chose
        self._lens: list[int] = []  # their lengths then
        self._stands = False
        self._kept: dict[int, T] = {}

    def lookup(self, layer: int, tables: torch.Tensor, lens: torch.Tensor) -> T | None:
        """The selection this layer made for these rows, if it still stands; None: choose (and
        `keep` what was chosen)."""
        if self.every == 1:
            return None
        if layer <= self._layer or self._tables is None:  # a new step
            self._stands = self._still_stands(tables, lens)
            if self._stands:
                self.reused += 1
            else:
                self.chosen += 1
                self._kept.clear()
                self._tables = tables.clone()
                self._lens = lens.tolist()
        self._layer = layer
        return self._kept.get(layer) if self._stands else None

    def keep(self, layer: int, selection: T) -> None:
        if self.every > 1:
            self._kept.setdefault(layer, selection)

    def _still_stands(self, tables: torch.Tensor, lens: torch.Tensor) -> bool:
        before = self._tables
        if before is None or tables.shape[0] != before.shape[0]:
            return False
        bs = self.block_size
        now = lens.tolist()
        for n, then in zip(now, self._lens, strict=True):
            if not 0 < n - then < self.every or (n - 1) // bs != (then - 1) // bs:
                return False
        used = max((n + bs - 1) // bs for n in now) if now else 0
        if tables.shape[1] < used or before.shape[1] < used:
            return False
        return torch.equal(tables[:, :used], before[:, :used])
