"""KV memory per layer type: a model whose local layers attend to a sliding window (Gemma 3: five
local layers of 512 tokens to one global) keeps only their window, as vLLM's hybrid KV cache manager
does.

The cache is a pool of pages; a page holds `block_size` tokens of as many layers as the model has
global layers (its storage slots). A block of a request's table is one page: the global layers'
keys and values, read through the table as before. The local layers come in groups of that many
(the last padded), and each group keeps its own page per block, the block's companion, reached
through a page map [blocks, groups]. A request holds companions only for the blocks some query
still to come can see: a block that has left the window gives its companion pages back while its
global page stays (a prefix hit needs the global layers' every block, the local layers' last
window only). One pool serves both, so nothing splits the budget ahead of time: a 32K request
takes its 2048 global pages plus five groups' ~34 window pages where every layer's 2048 blocks
took six times the memory before.

Models with no local layer, or no global one, keep the plain layout (one page per block, every
layer); so do the caches and modes that move whole blocks (quantized caches with their staging,
KV tiers, pruning): `layout_for` says which.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PageLayout:
    slots: tuple[int, ...]  # per layer: the storage slot (of a page) it reads and writes
    groups: tuple[int, ...]  # per layer: -1 for a global layer (the block table), else its local group
    num_slots: int  # layers a page holds: the global layers' count
    num_groups: int  # local groups: companion pages per block
    window: int  # the widest local window, in tokens (the query's own position included)

    def window_start(self, position: int, block_size: int) -> int:
        """The first block a query at `position` (or any later one) can see in a local layer."""
        return max(0, position - self.window + 1) // block_size

    def window_blocks(self, chunk: int, block_size: int) -> int:
        """The most blocks one request's window and a chunk of `chunk` new tokens span at once."""
        return math.ceil((self.window - 1 + chunk) / block_size) + 2

    def describe(self) -> str:
        return (
            f"per layer type: pages of {self.num_slots} layers, {self.num_groups} local groups keep "
            f"their last {self.window} tokens"
        )


def page_layout(windows: Sequence[int | None]) -> PageLayout | None:
    """The paged layout for these per-layer windows (None: attends to all); None when the plain
    layout is as good (no local layer, or no global one)."""
    globals_ = [i for i, w in enumerate(windows) if w is None]
    local = [i for i, w in enumerate(windows) if w is not None]
    if not globals_ or not local:
        return None
    n = len(globals_)
    slots = [0] * len(windows)
    groups = [-1] * len(windows)
    for s, i in enumerate(globals_):
        slots[i] = s
    for j, i in enumerate(local):
        groups[i], slots[i] = divmod(j, n)
    window = max(w for w in windows if w is not None)
    return PageLayout(tuple(slots), tuple(groups), n, math.ceil(len(local) / n), window)


def blocks_for_context(layout: PageLayout | None, tokens: int, chunk: int, block_size: int) -> int:
    """Pages one request of `tokens` tokens takes at its peak, prefilled in chunks of `chunk`."""
    blocks = math.ceil(tokens / block_size)
    if layout is None:
        return blocks
    return blocks + layout.num_groups * min(blocks, layout.window_blocks(chunk, block_size))


def resident_pages(layout: PageLayout | None, tokens: int, block_size: int) -> int:
    """Pages a request of `tokens` tokens holds while it decodes (its prompt computed)."""
    blocks = math.ceil(tokens / block_size)
    if layout is None:
        return blocks
    return blocks + layout.num_groups * min(blocks, math.ceil((layout.window - 1) / block_size) + 1)
